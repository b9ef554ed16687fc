"""Durable output: blocks reserved before the first byte (`fallocate`), writeback started as each move
lands (`sync_file_range`), and each file fsynced on its own thread as soon as its last move is done."""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from types import TracebackType

from stagerd.engine.plan_types import Move

_SYNC_FILE_RANGE_WRITE = 2


def _sync_file_range() -> Callable[[int, int, int, int], int] | None:
    """libc's sync_file_range, which `os` lacks; None without it (writeback is then left to fsync)."""
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


class Flusher:
    """Durability without a stall at the end: the disk writes while the CPU is still copying the next file.

    Use as a context manager; `done` after each move, `finish` once all moves are done.
    """

    def __init__(self, fds: Sequence[int], data_sizes: Sequence[int]) -> None:
        self.fds = fds
        # Bytes, not moves, tell when a file is complete: the moves tile its data section exactly once,
        # and they are streamed, so their count is not known up front.
        self.left = list(data_sizes)
        self.lock = threading.Lock()
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="stagerd-fsync")
        self.futures: dict[int, Future[None]] = {}
        self.writeback = _sync_file_range()

    def __enter__(self) -> Flusher:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.pool.shutdown()

    def done(self, m: Move) -> None:
        fd = self.fds[m.file]
        if self.writeback is not None:
            self.writeback(
                fd, m.dst_offset, m.length, _SYNC_FILE_RANGE_WRITE
            )  # a hint: errors surface in fsync
        with self.lock:
            self.left[m.file] -= m.length
            if self.left[m.file] == 0 and m.length:
                self.futures[m.file] = self.pool.submit(os.fsync, fd)

    def finish(self) -> None:
        """fsync the files no move touched, then wait for every fsync; its error is the write's error."""
        for i, fd in enumerate(self.fds):
            if i not in self.futures:
                self.futures[i] = self.pool.submit(os.fsync, fd)
        for f in self.futures.values():
            f.result()


def reserve(fd: int, size: int) -> None:
    """Reserve the blocks up front so a full disk fails before any copying, not halfway."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise
        os.ftruncate(fd, size)
