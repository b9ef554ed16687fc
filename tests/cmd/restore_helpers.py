"""What the `stagerd restore` tests share: a committed raw step to publish, a directory's files, and one
run of the `stagerd restore` child, and the wait for the line a child held at a delay point says."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from stagerd.contract import layout
from tests.cli_helpers import run_cli
from tests.dcp_fixtures import commit_step


def raw_step(root: Path, s: int, model_src: Path) -> Path:
    step_dir = root / layout.step_dir_name(s)
    (step_dir / "optim").mkdir(parents=True)
    (step_dir / "optim" / "__0_0.distcp").write_bytes(bytes(range(256)) * (100 + s))
    (step_dir / "extras").mkdir()
    (step_dir / "extras" / "loader.json").write_text(json.dumps({"pos": s}))
    shutil.copytree(model_src, step_dir / "model")
    commit_step(step_dir, 2)
    return step_dir


@contextmanager
def hub_with_step(tmp_path: Path, step: int = 7) -> Iterator[tuple[Any, str, dict, Path]]:
    """The repo's Hub server holding an HF export published as `step` by the Hub sink: (the server, its
    `hf://` URL, the environment of a `stagerd restore` child (token, Xet uploads), the export)."""
    from tests.hubserver import HubConfig, HubServer
    from tests.sinks.hub.hub_helpers import REPO, make_sink, write_export

    with HubServer(config=HubConfig()) as hub:
        export = write_export(tmp_path / "export")
        make_sink(hub).publish(export, step)
        env = {"HF_TOKEN": hub.token, "HF_HUB_DISABLE_XET": None}  # Xet
        yield hub, f"hf://{REPO}?endpoint={hub.endpoint}", env, export


def tree(d: Path) -> dict[str, bytes]:
    return {p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def run_restore(url: str, root: Path, *args: str, env: dict | None = None):
    return run_cli(["restore", url, root, *args], env=env, timeout=120)


def wait_for_line(proc: subprocess.Popen[str], text: str, seconds: float = 60) -> str:
    """The child's stderr up to the line holding `text` (it is then held at a delay point)."""
    assert proc.stderr is not None
    seen = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        seen.append(line)
        if text in line:
            return "".join(seen)
        if not line and proc.poll() is not None:
            break
    raise AssertionError(f"{text!r} never came: {''.join(seen)[-2000:]}")
