"""`execute()` writes a plan's files; `compare()` re-derives every byte of an export from its sources."""

from __future__ import annotations

import errno
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from stagerd.contract.progress_fn import ProgressFn
from stagerd.contract.step.input_fds import LazyFds, close_inputs, open_inputs
from stagerd.engine.durability import Flusher, reserve
from stagerd.engine.file_header import file_header, header_difference
from stagerd.engine.moves import by_source, plan_moves
from stagerd.engine.plan_types import ExportPlan, Move
from stagerd.engine.runner import Runner, pwrite_all, run_moves
from stagerd.errors import OutputError, VerifyError


def output_error(e: OSError, path: object) -> OutputError:
    """The named error for a failed write: a full disk and a read-only target say so and how to fix it."""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return OutputError(
            "no space left on the output filesystem",
            path=path,
            hint="free space on the output filesystem, then retry",
        )
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return OutputError(f"not writable: {e.strerror}", path=path)
    return OutputError(f"write failed: {e.strerror or e}", path=path)


def execute(
    p: ExportPlan, out_dir: Path, *, threads: int = 2, progress: ProgressFn | None = None, fsync: bool = True
) -> None:
    """Write the plan's files into `out_dir` (an empty directory the caller renames into place)."""
    src_fds = open_inputs(p.sources)
    dst_fds: list[int] = []
    dst_paths = [str(out_dir / f.name) for f in p.files]
    try:
        for fi, (f, path) in enumerate(zip(p.files, dst_paths, strict=True)):
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
                dst_fds.append(fd)
                reserve(fd, f.size)
                pwrite_all(fd, memoryview(file_header(p, fi)), 0)
            except OSError as e:
                raise output_error(e, path) from None
        runner = Runner(src_fds, list(p.sources), dst_fds, dst_paths, compare=False)
        try:
            if not fsync:
                run_moves(runner, _moves(p, src_fds), threads, progress, p.bytes_to_write)
                return
            with Flusher(
                dst_fds, [f.header_size for f in p.files], [f.data_size for f in p.files]
            ) as flusher:
                run_moves(runner, _moves(p, src_fds), threads, progress, p.bytes_to_write, flusher.done)
                flusher.finish()
        except OSError as e:
            raise output_error(e, out_dir) from None
    finally:
        close_inputs(src_fds)
        for fd in dst_fds:
            os.close(fd)


def _moves(p: ExportPlan, src_fds: Sequence[int]) -> Iterator[Move]:
    """The plan's moves; grouped by source a batch at a time where its inputs are more than may stay open
    (each file then opened again once a batch, not once a piece: `moves.by_source`)."""
    moves = plan_moves(p)
    return by_source(moves) if isinstance(src_fds, LazyFds) else moves


_HEADER_HINT = (
    "the export's header does not describe what its source gives (another export, or edited?): re-run "
    "`stagerd consolidate`; never publish an export that fails verify"
)


def _tensor_at(p: ExportPlan) -> Callable[[int, int], str]:
    """The tensor that holds byte `offset` of output file `file`, by name, for compare's error."""

    def where(file: int, offset: int) -> str:
        f = p.files[file]
        at = offset - f.header_size
        for r in range(f.first, f.stop):
            if p.begin[r] <= at < p.end[r]:
                return f"tensor {p.chunks.names[p.tensor[r]]!r} (its byte {at - p.begin[r]})"
        return "a byte"

    return where


def compare(p: ExportPlan, export_dir: Path, *, threads: int = 2, progress: ProgressFn | None = None) -> None:
    """Re-derive every output byte from the sources and check the export holds exactly that."""
    src_fds = open_inputs(p.sources)
    dst_fds: list[int] = []
    dst_paths = [str(export_dir / f.name) for f in p.files]
    try:
        for fi, (f, path) in enumerate(zip(p.files, dst_paths, strict=True)):
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                raise VerifyError("missing from the export", path=path) from None
            dst_fds.append(fd)
            if os.fstat(fd).st_size != f.size:
                raise VerifyError(f"is {os.fstat(fd).st_size} bytes, the source gives {f.size}", path=path)
            if os.pread(fd, f.header_size, 0) != file_header(p, fi):
                raise VerifyError(header_difference(p, fi, path), path=path, hint=_HEADER_HINT)
        run_moves(
            Runner(src_fds, list(p.sources), dst_fds, dst_paths, compare=True, where=_tensor_at(p)),
            _moves(p, src_fds),
            threads,
            progress,
            p.bytes_to_write,
        )
    finally:
        close_inputs(src_fds)
        for fd in dst_fds:
            os.close(fd)
