"""The files of a raw staged step as `FsspecSink.publish_raw` sends them, read through held handles.

Exactly the commit marker and the files it lists, each opened from the step directory the caller holds
(`contract/step/held.HeldDir`, or one held here): every directory on its way (`model/`, `optim/`,
`extras/`...) held from its parent and the file opened from it, none through a link (`HeldFiles`), then
read by its own `/proc/self/fd/N`, which the kernel resolves to that very file. A `model/` or `optim/` (or
one shard) swapped for a link to another directory after the step was checked would otherwise send that
directory's bytes under this step's raw prefix, and its manifest vouch for them: a resume would restore
other weights or another optimizer. One descriptor per directory and per listed file, until the publish ends,
for as many files as the process's budget lets stay open: the rest are opened again when sent, each
checked to be the same file (`contract/step/reopen.py`).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
from collections.abc import Iterator
from pathlib import Path

from stagerd.contract import commit_marker, layout
from stagerd.contract.commit_marker import CommitMarker
from stagerd.contract.step.held import HeldDir, HeldFiles, reading
from stagerd.errors import MarkerError, ShardError, VerifyError, open_failed
from stagerd.sinks.objects import LocalFile

WHY = "a raw step is sent only from the files the trainer wrote in it, never through a link"
HINT = "replace the link by the directory or file it stands for (its target was left as it is), then retry"
UNCOMMITTED = "has no commit marker: only committed steps are published raw"


@contextlib.contextmanager
def held_raw_step(step_dir: Path | HeldDir) -> Iterator[tuple[CommitMarker, list[LocalFile], Path]]:
    """The step's marker, its files to send (by proc path, sorted) and the path the publish names it by;
    errors raised inside name the real paths."""
    with contextlib.ExitStack() as stack:
        if isinstance(step_dir, HeldDir):
            held = step_dir
        else:
            try:
                held = stack.enter_context(HeldDir.open(step_dir, why=WHY, hint=HINT))
            except FileNotFoundError:
                raise VerifyError(UNCOMMITTED, path=step_dir) from None
        files = stack.enter_context(HeldFiles())
        stack.enter_context(held.naming())
        stack.enter_context(files.naming())
        if not layout.is_committed(held.proc):
            raise VerifyError(UNCOMMITTED, path=held.path)
        marker_path = _open(files, held, layout.MARKER_NAME)
        marker = commit_marker.read_marker(held.proc)
        _same_marker(marker_path, marker, held.path / layout.MARKER_NAME)
        # missing, resized, or a link out of the step: named
        commit_marker.check_staged_files(held.proc, marker)
        sent = [LocalFile(layout.MARKER_NAME, marker_path, os.stat(marker_path).st_size)]
        for f in marker.files:
            path = _open(files, held, f.path, bounded=True)
            if (size := _size(path, held.path / f.path)) != f.size:
                raise ShardError(f"is {size} bytes, the commit marker lists {f.size}", path=path)
            sent.append(LocalFile(f.path, path, size))
        yield marker, sorted(sent, key=lambda f: f.rel), held.proc


def _open(files: HeldFiles, step: HeldDir, rel: str, *, bounded: bool = False) -> Path:
    """The proc path of the file `rel` (a marker's safe relative path) opened through held directories
    (`bounded`: see `HeldFiles`; the sinks open every file with `reopen.open_held`)."""
    try:
        return files.open_at(step, rel, why=WHY, hint=HINT, bounded=bounded)
    except OSError as e:
        if e.errno == errno.ENOENT:
            raise ShardError("listed in the commit marker but missing", path=step.path / rel) from None
        raise open_failed(e, step.path / rel, ShardError) from None


def _size(path: Path, named: Path) -> int:
    """The size of the file `path` opened; one closed for want of descriptors is opened again (the same
    file, else a SourceChangedError)."""
    try:
        with reading(path) as now:
            return os.stat(now).st_size
    except OSError as e:
        raise open_failed(e, named, ShardError) from None


def _same_marker(held: Path, marker: CommitMarker, named: Path) -> None:
    """The marker file sent (`held`) says what the marker parsed by name said: never another's beside the
    files of this one."""
    with open(held, "rb") as f:
        raw = f.read(commit_marker.MAX_MARKER_BYTES + 1)
    try:
        same = CommitMarker.from_json(json.loads(raw)).to_json() == marker.to_json()
    except (ValueError, RecursionError, MarkerError):
        same = False
    if not same:
        raise MarkerError("changed while the raw step was read (saved again?)", path=named)
