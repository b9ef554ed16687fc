"""Durable output: blocks reserved before the first byte (`fallocate`), writeback started as each move
lands (`sync_file_range`), the written pages dropped once they are on disk, and each file fsynced on its
own thread as soon as its last move is done.

Drop-behind: a new page-cache page is dear where the kernel has handed its free memory back to the host
(a VM with free page reporting: the first write into such a page faults on the host, 4-7x the CPU of the
copy into it, BENCHMARKS.md). So once a file's written prefix runs `limits.DROP_BEHIND` past a range, the
flusher thread waits for that range's writeback (`sync_file_range` WAIT_BEFORE|WRITE|WAIT_AFTER) and
drops it (`POSIX_FADV_DONTNEED`); the next writes reuse those pages while they are still the guest's.
The copy threads do not wait for it (a wait there let the disk's pauses stall the copy: 20% slower on a
quiet machine) unless `limits.DROP_QUEUE` drops are still pending, which bounds the page cache an export
holds whatever its size.
"""

from __future__ import annotations

import collections
import ctypes
import errno
import heapq
import os
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from types import TracebackType

from stagerd.engine import limits
from stagerd.engine.plan_types import Move
from stagerd.ops import libc

_DROP_ALIGN = 2 << 20  # whole huge-page-sized folios: a partly covered large folio is not dropped


class Flusher:
    """Durability without a stall at the end: the disk writes while the CPU is still copying the next file.

    Use as a context manager; `done` after each move, `finish` once all moves are done.
    """

    def __init__(self, fds: Sequence[int], header_sizes: Sequence[int], data_sizes: Sequence[int]) -> None:
        self.fds = fds
        # Bytes, not moves, tell when a file is complete: the moves tile its data section exactly once,
        # and they are streamed, so their count is not known up front.
        self.left = list(data_sizes)
        self.written = list(header_sizes)  # per file: bytes [0, written) are all written
        self.ahead: list[list[tuple[int, int]]] = [[] for _ in fds]  # finished ranges past `written`
        self.dropped = [0] * len(fds)
        self.drops: collections.deque[Future[None]] = collections.deque()  # pending, oldest first
        self.lock = threading.Lock()
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="stagerd-fsync")
        self.futures: dict[int, Future[None]] = {}
        self.writeback = libc.sync_file_range()

    def __enter__(self) -> Flusher:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.pool.shutdown()

    def done(self, m: Move) -> None:
        fd = self.fds[m.file]
        if self.writeback is not None:
            # a hint: errors surface in fsync
            self.writeback(fd, m.dst_offset, m.length, libc.SYNC_FILE_RANGE_WRITE)
        with self.lock:
            self.left[m.file] -= m.length
            if self.left[m.file] == 0 and m.length:
                self.futures[m.file] = self.pool.submit(self._sync, m.file)
            elif m.length and (drop := self._advance(m)) is not None:
                self.drops.append(self.pool.submit(self._drop, fd, *drop))
        while len(self.drops) > limits.DROP_QUEUE:  # the disk is far behind: wait for the oldest drop
            try:
                oldest = self.drops.popleft()
            except IndexError:  # the other copy thread took it
                break
            oldest.result()

    def _advance(self, m: Move) -> tuple[int, int] | None:
        """Record `m` as written; the range to drop now, if the written prefix has run far enough past it."""
        f, ahead = m.file, self.ahead[m.file]
        heapq.heappush(ahead, (m.dst_offset, m.dst_offset + m.length))
        while ahead and ahead[0][0] == self.written[f]:
            self.written[f] = heapq.heappop(ahead)[1]
        window = limits.DROP_BEHIND
        end = (self.written[f] - window) // _DROP_ALIGN * _DROP_ALIGN
        if window <= 0 or self.writeback is None or end - self.dropped[f] < window:
            return None
        start, self.dropped[f] = self.dropped[f], end
        return start, end

    def _drop(self, fd: int, start: int, end: int) -> None:
        # On the flusher thread. Only clean pages can be dropped, so wait for this range's writeback. A
        # failed wait is the export's failure: it consumes the error that fsync would otherwise report.
        assert self.writeback is not None  # _advance drops nothing without it
        if self.writeback(fd, start, end - start, libc.SYNC_FILE_RANGE_DURABLE) != 0:
            e = ctypes.get_errno()
            raise OSError(e, os.strerror(e))
        os.posix_fadvise(fd, start, end - start, os.POSIX_FADV_DONTNEED)

    def _sync(self, file: int) -> None:
        fd = self.fds[file]
        os.fsync(fd)
        if limits.DROP_BEHIND > 0:  # the file is on disk: none of its pages need stay
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def finish(self) -> None:
        """fsync the files no move touched, then wait for every fsync; its error is the write's error."""
        while self.drops:  # a failed drop is the export's failure
            self.drops.popleft().result()
        for i in range(len(self.fds)):
            if i not in self.futures:
                self.futures[i] = self.pool.submit(self._sync, i)
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
