"""What the `stagerd restore` tests share: a committed raw step to publish, a directory's files, and one
run of the `stagerd restore` child."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

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


def tree(d: Path) -> dict[str, bytes]:
    return {p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def run_restore(url: str, root: Path, *args: str, env: dict | None = None):
    return run_cli(["restore", url, root, *args], env=env, timeout=120)
