"""The commit marker and the extras it lists, written by the committer once every part is written.

The marker lists exactly the files the writers reported (model/, optim/, extras/), never a directory
listing, plus `tensors` (global dtype and shape of every model tensor, from DCP's global metadata) and
`world_size`. It is written atomically (temp name, fsync, rename, directory fsync), after an all-ranks
check-in that every part of the save succeeded. A failed save never writes a marker. A step whose
directory already has a marker is refused with `StepExistsError` on every rank. A step directory without
a marker is a crashed, uncommitted save: its `model/`, `optim/` and `extras/`, and the daemon's export of
an earlier save, are removed before the new save writes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
from pathlib import Path

from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from stagerd.contract import commit_marker, layout
from stagerd.contract.dtypes import safetensors_name
from stagerd.contract.step.lock import StepLock
from stagerd.errors import SaveError, StepExistsError, SymlinkError
from stagerd.ops.crashpoints import delay_point
from stagerd.training.save_inputs import Extra

log = logging.getLogger("stagerd.stage")


_SAVED = (layout.MODEL_DIR, layout.OPTIM_DIR, layout.EXTRAS_DIR)  # what a save writes in its step directory
_held: dict[Path, StepLock] = {}  # step dir -> the lock its save holds until its marker (step/lock.py)


def _hold(step_dir: Path) -> None:
    """Hold the step's lock until its marker is written, so `stagerd restore` never lands into a save
    in progress; a failed save of another step under this ROOT gives its lock back now."""
    for other in [d for d in _held if d.parent == step_dir.parent and d != step_dir]:
        _held.pop(other).release()
    if step_dir not in _held:
        step = layout.parse_step_dir(step_dir.name)
        if step is not None:
            _held[step_dir] = StepLock(step_dir.parent, step, "a Stager save").acquire()


def clear_stale(step_dir: Path) -> None:
    """Leader: take the step's lock, then clear what a crashed, uncommitted save of this step left."""
    _hold(step_dir)
    _refuse_links(step_dir)
    if layout.is_committed(step_dir):  # a restore landed it since the check before the check-in
        raise StepExistsError("step is already committed; refusing to overwrite it", path=step_dir)
    # The daemon's export of the earlier save too: with the same options it would be taken as this save's.
    stale = [step_dir / d for d in (*_SAVED, layout.EXPORT_DIR, layout.EXPORT_TMP_DIR)]
    stale = [p for p in stale if p.exists()]
    if stale:
        log.warning("removing an uncommitted earlier save of %s: %s", step_dir, [p.name for p in stale])
        for p in stale:
            shutil.rmtree(p)
    (step_dir / layout.EXPORT_OPTIONS_NAME).unlink(missing_ok=True)


def clear_failed(step_dir: Path) -> None:
    """Leader, once every rank checked in and the save failed: remove what it wrote, so its fallocated files
    do not hold the disk (nothing else ever removes an uncommitted step), and give the step's lock back.
    Only a step this save holds the lock of, that is no link and has no marker (a restore that landed it)."""
    held = _held.get(step_dir)
    if held is None or step_dir.is_symlink() or layout.is_committed(step_dir):
        return
    for p in (step_dir / d for d in _SAVED):
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
    with contextlib.suppress(OSError):
        step_dir.rmdir()  # only when nothing else is left in it
    _held.pop(step_dir).release()
    log.info("removed the files of the failed save of %s", step_dir)


def _refuse_links(step_dir: Path) -> None:
    """The step directory and the directories a save clears and writes are its own, never a link: through
    one, clearing a crashed save would delete another directory's files, outside ROOT."""
    for p in (step_dir, *(step_dir / d for d in (*_SAVED, layout.EXPORT_DIR, layout.EXPORT_TMP_DIR))):
        if p.is_symlink():
            raise SymlinkError(
                f"is a symbolic link (-> {os.readlink(p)}); a save never clears or writes through a link",
                path=p,
                hint="remove the link (its target is left as it is), then save again; nothing was changed",
            )


def write_extras(step_dir: Path, extras: tuple[Extra, ...]) -> dict[str, tuple[int, int]]:
    """Rank 0: write extras/ durably (temp name, fsync, rename, directory fsync)."""
    out: dict[str, tuple[int, int]] = {}
    for e in extras:
        dst = step_dir / layout.EXTRAS_DIR / e.name
        dst.parent.mkdir(parents=True, exist_ok=True)
        if e.data is not None:
            layout.write_bytes_atomic(dst, e.data)
        else:
            assert e.source is not None
            tmp = dst.with_name(f".{dst.name}.tmp-{os.getpid()}")
            with open(e.source, "rb") as fin, open(tmp, "wb") as fout:
                shutil.copyfileobj(fin, fout, 1 << 20)
                fout.flush()
                os.fsync(fout.fileno())
            os.replace(tmp, dst)
            layout.fsync_dir(dst.parent)
        out[f"{layout.EXTRAS_DIR}/{e.name}"] = (dst.stat().st_size, 0)
    if extras:
        layout.fsync_dir(step_dir)
    return out


def tensor_infos(meta: Metadata) -> dict[str, commit_marker.TensorInfo]:
    """Global dtype and shape of every model tensor, from DCP's global metadata."""
    out = {}
    for fqn, md in meta.state_dict_metadata.items():
        if not isinstance(md, TensorStorageMetadata):
            raise SaveError(f"model state dict entry {fqn!r} is not a tensor")
        out[fqn] = commit_marker.TensorInfo(
            safetensors_name(md.properties.dtype), tuple(int(x) for x in md.size)
        )
    return out


def write_commit(step_dir: Path, marker: commit_marker.CommitMarker) -> None:
    """Node leader: make the step durable, then write its marker."""
    # The writers fsynced their files and model/ optim/ extras/; the step dir's own entries and its entry
    # in the root are made durable here, off the training's critical path.
    layout.fsync_dir(step_dir)
    layout.fsync_dir(step_dir.parent)
    delay_point("save.marker")
    commit_marker.write_marker(step_dir, marker)
    if (held := _held.pop(step_dir, None)) is not None:
        held.release()
    sizes = [f.size for f in marker.files]
    log.info("committed step %d: %d files, %d bytes", marker.step, len(sizes), sum(sizes))
