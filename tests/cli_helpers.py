"""Run the `stagerd` command in a subprocess exactly as a user would, with a clean environment.

"Clean" means: no `STAGERD_*` setting and no systemd `NOTIFY_SOCKET` leak in from the test runner, the repo
on `PYTHONPATH` so the child imports this checkout, no metrics port (parallel children must not fight over
9464), no colour, and stdin closed so nothing can wait for input. `env` entries are added on top (a value of
None removes that variable).

Besides settings, `env` may hold the TEST ONLY variables that no user setting offers (read by
stagerd/daemon/tasks.py): STAGERD_TEST_PAUSE_AT=export|publish parks the worker inside its first progress
report, i.e. with the export or upload under way, so a test can kill the daemon exactly there;
STAGERD_TEST_PAUSE_SECONDS is how long it stays parked (default 3600).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
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
    preexec: Callable[[], None] | None = None,
) -> subprocess.CompletedProcess[str]:
    """`stagerd ARGS...` to completion, with stdout and stderr captured as text.

    `preexec` runs in the child before it starts (e.g. to set a resource limit there). A child still running
    at `timeout` is made to log its tasks' awaits (SIGUSR1, `stagerd.ops.stacks`) and then to print every
    thread's stack (faulthandler, on SIGABRT) before it ends, and the test fails with that: a hang that
    shows once in a hundred CI runs names where it waited.
    """
    proc = subprocess.Popen(
        [*STAGERD, *(str(a) for a in args)],
        env=clean_env({"PYTHONFAULTHANDLER": "1", **(env or {})}),
        cwd=str(cwd) if cwd is not None else None,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        stdin=subprocess.DEVNULL,
        preexec_fn=preexec,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGUSR1)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(2.0)
        proc.send_signal(signal.SIGABRT)
        try:
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        raise AssertionError(
            f"stagerd {' '.join(str(a) for a in args)} still ran after {timeout:g}s; its stacks, then "
            f"its output:\n{err[-20000:]}\n--- stdout ---\n{out[-3000:]}"
        ) from None
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def start_cli(
    args: Sequence[str | os.PathLike[str]],
    *,
    env: Mapping[str, str | None] | None = None,
) -> subprocess.Popen[str]:
    """`stagerd ARGS...` started in the background (a daemon), stdout and stderr piped as text."""
    return subprocess.Popen(
        [*STAGERD, *(str(a) for a in args)],
        env=clean_env(env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
    )
