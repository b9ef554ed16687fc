"""Carry out moves on open file descriptors with a pool of threads, each with its own fixed buffers.

`Runner.run` does one move; `run_moves` hands moves to `threads` workers in plan order, reports progress
and stops everyone at the first error. With `compare=True` every destination byte is read and checked
instead of written, so verify re-derives exactly what execute wrote.
"""

from __future__ import annotations

import errno
import itertools
import math
import os
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from stagerd.contract import dtypes
from stagerd.contract.progress_fn import ProgressFn
from stagerd.engine import limits
from stagerd.engine.cast import cast_into
from stagerd.engine.iov import gather_read, pread_into, scatter_read
from stagerd.engine.plan_types import Move, MoveKind, Piece
from stagerd.engine.strided import place, read_piece
from stagerd.engine.tiling import strides
from stagerd.errors import ShardError, VerifyError


class _Buffers(threading.local):
    """Per-thread buffers, allocated once and reused: fresh memory is expensive to touch."""

    a: bytearray
    b: bytearray

    def get(self) -> tuple[bytearray, bytearray]:
        if not hasattr(self, "a"):
            self.a = bytearray(limits.BUFFER_BYTES)
            self.b = bytearray(limits.BUFFER_BYTES)
        return self.a, self.b


def pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)


class Runner:
    """Carries out moves on open file descriptors. `compare=True` reads the destination and checks it."""

    def __init__(
        self,
        src_fds: Sequence[int],
        src_paths: Sequence[str],
        dst_fds: Sequence[int],
        dst_paths: Sequence[str],
        compare: bool,
        where: Callable[[int, int], str] | None = None,
    ):
        """`where(file, offset)`: what a differing byte at that offset of output file `file` belongs to
        (a tensor's name), for compare's error; a move (a pack above all) spans many tensors."""
        self.src_fds, self.src_paths = src_fds, src_paths
        self.dst_fds, self.dst_paths = dst_fds, dst_paths
        self.compare = compare
        self.where = where
        self.buffers = _Buffers()
        self.copy_file_range = hasattr(os, "copy_file_range") and not compare

    def run(self, m: Move) -> None:
        if m.kind is MoveKind.COPY:
            self._copy(m)
        elif m.kind is MoveKind.CAST:
            self._cast_run(m)
        else:
            self._gather(m)

    def _emit(self, m: Move, data: memoryview, offset: int) -> None:
        fd = self.dst_fds[m.file]
        if not self.compare:
            pwrite_all(fd, data, offset)
            return
        got = os.pread(fd, len(data), offset)
        if got != data:
            at = offset + next(
                (i for i, (x, y) in enumerate(zip(got, data, strict=False)) if x != y), len(got)
            )
            what = self.where(m.file, at) if self.where is not None else "a byte"
            raise VerifyError(
                f"{what} differs from the source, at file offset {at}", path=self.dst_paths[m.file]
            )

    def _copy(self, m: Move) -> None:
        src_fd, dst_fd = self.src_fds[m.src], self.dst_fds[m.file]
        done = 0
        while self.copy_file_range and done < m.length:
            try:
                n = os.copy_file_range(
                    src_fd, dst_fd, m.length - done, m.src_offset + done, m.dst_offset + done
                )
            except OSError as e:
                if e.errno in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
                    self.copy_file_range = False  # this filesystem pair cannot: fall back to pread/pwrite
                    break
                raise
            if n == 0:
                raise ShardError(
                    f"ends early at byte {m.src_offset + done} (truncated while reading?)",
                    path=self.src_paths[m.src],
                )
            done += n
        a, _ = self.buffers.get()
        while done < m.length:
            n = min(len(a), m.length - done)
            view = memoryview(a)[:n]
            pread_into(src_fd, view, m.src_offset + done, self.src_paths[m.src])
            self._emit(m, view, m.dst_offset + done)
            done += n

    def _cast_run(self, m: Move) -> None:
        sdt, ddt = dtypes.lookup(m.src_dtype), dtypes.lookup(m.dst_dtype)
        a, b = self.buffers.get()
        per = min(len(a), limits.CAST_ROUND) // max(sdt.bits, ddt.bits) * 8  # elements per round
        total = m.length * 8 // ddt.bits
        done = 0
        while done < total:
            n = min(per, total - done)
            sv = memoryview(a)[: sdt.nbytes(n)]
            dv = memoryview(b)[: ddt.nbytes(n)]
            pread_into(self.src_fds[m.src], sv, m.src_offset + sdt.nbytes(done), self.src_paths[m.src])
            cast_into(sv, dv, sdt.name, ddt.name)
            self._emit(m, dv, m.dst_offset + ddt.nbytes(done))
            done += n

    def _gather(self, m: Move) -> None:
        sdt, ddt = dtypes.lookup(m.src_dtype), dtypes.lookup(m.dst_dtype)
        isz = sdt.bits // 8
        a, b = self.buffers.get()
        n = math.prod(m.slab_shape)
        slab = np.frombuffer(a, dtype=np.uint8, count=n * isz).reshape(*m.slab_shape, isz)
        whole, scratch = memoryview(a), memoryview(b)
        slab_strides = [s * isz for s in strides(m.slab_shape)]
        pieces: Sequence[Piece] = m.pieces
        if len(m.slab_shape) == 1:  # a pack (engine/pack.py): back-to-back runs read by one preadv
            pieces = self._read_runs(m.pieces, a, isz)
        for pc in pieces:
            path = self.src_paths[pc.src]
            if pc.strides:  # a strided block (a transpose): read, then placed tile-wise
                corner = sum(lo * s for (lo, _), s in zip(pc.box, slab_strides, strict=True))
                for r in read_piece(self.src_fds[pc.src], path, pc, isz, scratch):
                    at = corner + sum(i * s for i, s in zip(r.at, slab_strides, strict=True))
                    place(whole, at, slab_strides, scratch, r.offset, r.strides, r.shape, isz)
                continue
            offsets, seg = _segments(pc.box, m.slab_shape, isz)
            if seg >= limits.SCATTER_MIN_SEGMENT:
                # Read straight into the slab rows: one preadv per limits.IOV_MAX segments, no extra copy.
                scatter_read(self.src_fds[pc.src], a, offsets, seg, pc.src_offset, path)
                continue
            view = scratch[: pc.length]
            pread_into(self.src_fds[pc.src], view, pc.src_offset, path)
            shape = tuple(hi - lo for lo, hi in pc.box)
            src = np.frombuffer(view, dtype=np.uint8).reshape(*shape, isz)
            slab[tuple(slice(lo, hi) for lo, hi in pc.box)] = src
        if sdt.name == ddt.name:
            self._emit(m, whole[: n * isz], m.dst_offset)
            return
        per = min(len(b), limits.CAST_ROUND) // max(sdt.bits, ddt.bits) * 8
        for i in range(0, n, per):  # in cache-sized rounds, like _cast_run
            k = min(per, n - i)
            dv = scratch[: ddt.nbytes(k)]
            cast_into(whole[sdt.nbytes(i) : sdt.nbytes(i + k)], dv, sdt.name, ddt.name)
            self._emit(m, dv, m.dst_offset + ddt.nbytes(i))

    def _read_runs(self, pieces: Sequence[Piece], slab: bytearray, isz: int) -> list[Piece]:
        """Read the row-major pieces of a one-row slab, each stretch of back-to-back source runs with one
        preadv; the strided ones (a transposed view) are returned for the tile-wise path."""
        left: list[Piece] = []
        i, n = 0, len(pieces)
        while i < n:
            pc = pieces[i]
            if pc.strides:
                left.append(pc)
                i += 1
                continue
            offsets: list[int] = []
            lengths: list[int] = []
            end = pc.src_offset
            while i < n and (q := pieces[i]).src == pc.src and q.src_offset == end and not q.strides:
                count, step = q.rows
                lo = q.box[0][0] * isz
                if count == 1:
                    offsets.append(lo)
                    lengths.append(q.length)
                else:  # evenly spaced runs of a block split inside its rows
                    run = q.length // count
                    offsets.extend(range(lo, lo + count * step * isz, step * isz))
                    lengths.extend(itertools.repeat(run, count))
                end += q.length
                i += 1
            gather_read(self.src_fds[pc.src], slab, offsets, lengths, pc.src_offset, self.src_paths[pc.src])
        return left


def _segments(box: Sequence[tuple[int, int]], slab_shape: Sequence[int], isz: int) -> tuple[np.ndarray, int]:
    """Byte offsets in the slab of a piece's contiguous destination segments, and their common length."""
    k = len(slab_shape) - 1
    while k > 0 and tuple(box[k]) == (0, slab_shape[k]):
        k -= 1
    slab_strides = strides(slab_shape)
    offsets = np.array([box[k][0] * slab_strides[k]], dtype=np.int64)
    for d in range(k - 1, -1, -1):
        offsets = (
            np.arange(box[d][0], box[d][1], dtype=np.int64)[:, None] * slab_strides[d] + offsets[None, :]
        ).ravel()
    return offsets * isz, (box[k][1] - box[k][0]) * slab_strides[k] * isz


def run_moves(
    runner: Runner,
    moves: Iterable[Move],
    threads: int,
    progress: ProgressFn | None,
    total: int,
    on_done: Callable[[Move], None] | None = None,
) -> None:
    """Run `moves` on `threads` workers; the first error stops them all and is raised here.

    `moves` may be a generator: it is advanced under the lock, one move at a time."""
    lock = threading.Lock()
    nxt = iter(moves)
    done = 0
    error: BaseException | None = None

    def worker() -> None:
        nonlocal done, error
        while True:
            with lock:
                m = next(nxt, None) if error is None else None
            if m is None:
                return
            try:
                runner.run(m)
                if on_done is not None:
                    on_done(m)
            except BaseException as e:
                with lock:
                    error = error or e
                return
            with lock:
                done += m.length
                so_far = done
            if progress is not None:
                progress(so_far, total)

    n = max(1, threads)
    if n == 1:
        worker()
    else:
        with ThreadPoolExecutor(n, thread_name_prefix="stagerd-export") as pool:
            for f in [pool.submit(worker) for _ in range(n)]:
                f.result()
    if error is not None:
        raise error
