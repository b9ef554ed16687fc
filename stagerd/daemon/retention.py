"""Retention: which staged steps may go, and deleting them so that a crash never leaves half a step.

The plan is pure. The newest `keep_last` live steps (any state) keep their staged data; an older step is
deleted only when it is `published` on every sink, oldest first. A step that is not published (exporting,
failed, quarantined, waiting for a sink) is never deleted, whatever the disk pressure: the daemon reports
low disk instead.

Deleting renames the step directory into `ROOT/.stagerd/trash/` (one atomic rename: the step is gone from
ROOT, never half there), then removes the trash. Leftovers from a crash are removed at the next start.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import shutil
import stat
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from stagerd.contract import layout
from stagerd.contract.step.held import HeldDir
from stagerd.ops.crashpoints import crash_point

log = logging.getLogger("stagerd")

TRASH_DIR = "trash"
ASIDE = ".retired."  # in the dot name a step is set aside under when the trash is on another filesystem
_ASIDE_STEP = re.compile(r"\.step-[0-9]{8,}\.retired\.[0-9]+\.[0-9]+")  # in ROOT: only step directories'
_ASIDE_ANY = re.compile(r"\..+\.retired\.[0-9]+\.[0-9]+")  # in stagerd's own export directory


@dataclass(frozen=True)
class StepView:
    """What retention needs to know about one live (not retired) step."""

    step: int
    published: bool
    pinned: bool = False  # a trainer holds it (`contract/step/pin.py`)


def plan_retention(steps: Sequence[StepView], keep_last: int | None) -> list[int]:
    """Steps whose staged data may be deleted now, oldest first. `keep_last=None` keeps everything. A pinned
    step is kept, and is not one of the `keep_last`: those are the newest others."""
    if keep_last is None:
        return []
    ordered = sorted((s for s in steps if not s.pinned), key=lambda s: s.step)
    older = ordered[: max(0, len(ordered) - keep_last)]
    return [s.step for s in older if s.published]


@dataclass(frozen=True)
class DiskState:
    """Free space of the filesystem holding ROOT, and whether it is below the warning threshold."""

    free: int
    total: int
    low: bool

    @property
    def free_percent(self) -> float:
        return 100.0 * self.free / self.total if self.total else 100.0


def disk_state(root: str | os.PathLike[str], *, low_percent: float, low_bytes: int) -> DiskState:
    """Measure ROOT's filesystem; `low` when free space is under either threshold."""
    usage = shutil.disk_usage(root)
    pct = 100.0 * usage.free / usage.total if usage.total else 100.0
    low = pct < low_percent or (low_bytes > 0 and usage.free < low_bytes)
    return DiskState(usage.free, usage.total, low)


def trash_dir(root: str | os.PathLike[str]) -> Path:
    return Path(root) / layout.STATE_DIR / TRASH_DIR


def _held_trash(trash: Path) -> HeldDir:
    """The trash, held open: everything in it is deleted, so every rename into it and every delete in it
    is made from this handle. A trash that is a link (now, or put there later) would otherwise take retired
    steps elsewhere and empty whatever directory it points to."""
    return HeldDir.open(
        trash,
        why="stagerd deletes everything in its trash",
        hint="remove the link (its target is left as it is); stagerd makes its own trash directory",
    )


def move_to_trash(root: str | os.PathLike[str], step_dir: str | os.PathLike[str]) -> Path | None:
    """Atomically take `step_dir` out of ROOT; returns its trash path (None if it was already gone)."""
    trash = trash_dir(root)
    with contextlib.suppress(FileExistsError):  # a link there too: refused as the trash is held
        trash.mkdir(parents=True, exist_ok=True)
    src = Path(step_dir)
    name = f"{src.name}.{os.getpid()}.{time.time_ns()}"
    with _held_trash(trash) as held:
        try:
            os.rename(src, name, dst_dir_fd=held.fd)
        except FileNotFoundError:
            return None
        layout.fsync_dir(src.parent)
        held.fsync()
    crash_point("retention.trashed")
    return trash / name


def set_aside(path: Path) -> Path | None:
    """Where the trash is on another filesystem (`ROOT/.stagerd` linked to another disk, an export
    directory elsewhere): take `path` out of sight by one rename to a dot name beside it, never a step's;
    returns that name (None if it was already gone). Removing it then cannot leave half a step."""
    aside = path.with_name(f".{path.name}{ASIDE}{os.getpid()}.{time.time_ns()}")
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return None
    layout.fsync_dir(path.parent)
    crash_point("retention.trashed")
    return aside


def remove_step_data(root: Path, path: Path) -> bool:
    """Into ROOT's trash by one rename when it is on ROOT's filesystem, else set aside by one rename beside
    it and removed there (`ROOT/.stagerd` or an export directory on another disk). False when `path` was
    already gone."""
    try:
        return move_to_trash(root, path) is not None
    except OSError as e:
        if e.errno != errno.EXDEV:
            raise
        aside = set_aside(path)
        if aside is not None:
            shutil.rmtree(aside, ignore_errors=True)
        return aside is not None


def empty_trash(root: str | os.PathLike[str], *elsewhere: Path) -> int:
    """Remove everything in the trash (retired steps, crash leftovers), and what was set aside in ROOT or
    `elsewhere` (an adopted checkpoints' export directory); returns the entries removed."""
    trash = trash_dir(root)
    try:
        held: HeldDir | None = _held_trash(trash)
    except (FileNotFoundError, NotADirectoryError):
        held = None
    with held or contextlib.nullcontext():
        # (path named in messages, name, directory fd or None): the trash's entries relative to its handle
        entries: list[tuple[Path, str, int | None]] = (
            [(trash / e.name, e.name, held.fd) for e in os.scandir(held.fd)] if held else []
        )
        for place, names in ((Path(root), _ASIDE_STEP), *((Path(p), _ASIDE_ANY) for p in elsewhere)):
            if place.is_dir():  # only directories under the names set_aside gives
                entries += [
                    (Path(e.path), e.path, None)
                    for e in os.scandir(place)
                    if names.fullmatch(e.name) and e.is_dir(follow_symlinks=False)
                ]
        n = 0
        for path, name, dir_fd in entries:
            crash_point("retention.rmtree")
            try:
                if stat.S_ISDIR(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode):
                    shutil.rmtree(name, dir_fd=dir_fd)  # fd-based: it follows no link it meets
                else:
                    os.unlink(name, dir_fd=dir_fd)
                n += 1
            except OSError as e:
                log.warning("cannot remove %s from the trash: %s", path, e)
    return n
