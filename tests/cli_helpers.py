"""Run the `stagerd` command in a subprocess exactly as a user would, with a clean environment.

"Clean" means: no `STAGERD_*` setting and no systemd `NOTIFY_SOCKET` leak in from the test runner, the repo
on `PYTHONPATH` so the child imports this checkout, no metrics port (parallel children must not fight over
9464), no colour, and stdin closed so nothing can wait for input. `env` entries are added on top (a value of
None removes that variable).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
STAGERD = (sys.executable, "-m", "stagerd.cli")


def clean_env(env: Mapping[str, str | None] | None = None) -> dict[str, str]:
    """The environment a `stagerd` child gets: the runner's, minus stagerd's own settings, plus `env`."""
    out = {k: v for k, v in os.environ.items() if not k.startswith("STAGERD_") and k != "NOTIFY_SOCKET"}
    out.update(PYTHONPATH=str(REPO), STAGERD_METRICS_PORT="off", NO_COLOR="1")
    for key, value in (env or {}).items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = value
    return out


def run_cli(
    args: Sequence[str | os.PathLike[str]],
    *,
    env: Mapping[str, str | None] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    timeout: float = 120,
) -> subprocess.CompletedProcess[str]:
    """`stagerd ARGS...` to completion, with stdout and stderr captured as text."""
    return subprocess.run(
        [*STAGERD, *(str(a) for a in args)],
        env=clean_env(env),
        cwd=str(cwd) if cwd is not None else None,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
        check=False,
    )
