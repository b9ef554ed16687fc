"""Where a demo run writes, what it publishes to, and what it found: the plan and the result."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stagerd.errors import StagerdError

WORLD = 2  # gloo training processes


class DemoError(StagerdError):
    """A demo phase that failed; the message names the phase and the hint says where to look."""

    hint = "rerun with --debug; the demo directory is kept for inspection"


@dataclass(frozen=True)
class DemoPlan:
    """Where the demo writes and what it publishes to."""

    workdir: Path
    sinks: tuple[str, ...]
    steps: int = 3

    @property
    def staging(self) -> Path:
        return self.workdir / "staging"

    @property
    def published(self) -> Path:
        return self.workdir / "published"

    @property
    def expected(self) -> Path:
        return self.workdir / "expected"

    @property
    def downloaded(self) -> Path:
        return self.workdir / "downloaded"


@dataclass
class DemoResult:
    """What the demo did: the summary prints this."""

    plan: DemoPlan
    train_seconds: float = 0.0
    save_stall_seconds: list[float] = field(default_factory=list)
    watch_seconds: float = 0.0
    staged_bytes: dict[int, int] = field(default_factory=dict)
    status: list[dict[str, Any]] = field(default_factory=list)
    checked: dict[int, str] = field(default_factory=dict)  # step -> where the checked copy lives
    tensors: int = 0


def make_plan(root: Path | None, sinks: list[str] | None, steps: int = 3) -> DemoPlan:
    """A new temp directory unless `root` is given; the local sink `DIR/published` unless `sinks` are.

    Every sink URL is checked before anything is created, so a mistyped one costs no training run."""
    from stagerd.sinks.urls import parse_sink_url

    for url in sinks or []:
        parse_sink_url(url)
    if steps < 1:
        raise DemoError("--steps must be at least 1", hint="pass --steps 3, for example")
    if root is not None:
        staging = root.resolve() / "staging"
        if staging.exists() and any(staging.iterdir()):
            raise DemoError(
                "already holds a demo run",
                path=root.resolve(),
                hint="pass a new --root, or delete that directory first",
            )
    workdir = Path(tempfile.mkdtemp(prefix="stagerd-demo-")) if root is None else root.resolve()
    chosen = list(sinks or []) or [str(workdir / "published")]  # a bare path: as_uri() escapes a space
    return DemoPlan(workdir=workdir, sinks=tuple(chosen), steps=steps)
