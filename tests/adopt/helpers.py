"""What the adoption tests share: running `watch --adopt --once`, and proving a source untouched."""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path
from typing import Any

from stagerd.contract import layout
from tests.cli_helpers import run_cli
from tests.daemon_helpers import fast_flags


def tree_digest(root: Path) -> dict[str, tuple[str, int]]:
    """relative path -> (sha256, mode) of every file under `root` but stagerd's own `.stagerd/`."""
    out: dict[str, tuple[str, int]] = {}
    for dirpath, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d != layout.STATE_DIR]
        for name in files:
            p = Path(dirpath) / name
            mode = p.lstat().st_mode
            digest = hashlib.sha256(p.read_bytes()).hexdigest() if stat.S_ISREG(mode) else ""  # not a FIFO
            out[str(p.relative_to(root))] = (digest, mode)
    return out


def watch_once(root: Path, sink: Path, *flags: str, env: dict[str, str | None] | None = None) -> Any:
    """`stagerd watch ROOT --adopt --sink file://SINK --once ...`: the completed process."""
    return run_cli(
        ["watch", root, "--adopt", "--sink", f"file://{sink}", "--once", *fast_flags(), *flags],
        env=env,
        timeout=180,
    )


def published(sink: Path, step: int) -> Path:
    return sink / layout.step_dir_name(step)


def assert_passed_over_once(run: Path, sink: Path, said: str) -> None:
    """A watch of `run` publishes nothing, names why exactly once (`said`), and leaves `run` as it was."""
    before = tree_digest(run)
    res = watch_once(run, sink)
    out = res.stdout + res.stderr
    assert res.returncode == 0 and "0 step(s) published" in out, out
    assert out.count(said) == 1, out
    assert tree_digest(run) == before
