"""The descriptors an export reads its input files through, bounded whatever their number.

A plan of few inputs opens them all at once, as it always has. One of more inputs than the process may
hold open beside the held step's own (`ops/fdlimit.descriptor_budget`, less what `HeldFiles` holds) opens
each when first read and keeps the most recently read ones open: a step of 8,192 ranks is exported under a
hard limit of 4,096, at the cost of opening a file again each time the plan comes back to it. Every input
is opened with `reopen.open_held`: one closed for want of descriptors only as the very file first checked.
"""

from __future__ import annotations

import errno
import functools
import itertools
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import overload

from stagerd.contract.step import reopen
from stagerd.errors import ShardError, open_failed
from stagerd.ops.fdlimit import descriptor_budget, raise_open_files_limit

FLAGS = os.O_RDONLY | os.O_CLOEXEC


def open_inputs(paths: Sequence[str]) -> Sequence[int]:
    """A descriptor for each of `paths`, by index: all opened now when they fit, else `LazyFds`. Closed
    with `close_inputs`. A file that cannot be opened is a ShardError (a ResourceError out of descriptors)."""
    _room()
    cap = max(4, descriptor_budget() * 3 // 4 - reopen.held())
    if len(paths) > cap:
        return LazyFds(paths, cap)
    fds: list[int] = []
    try:
        for path in paths:
            fds.append(_open(path))
    except BaseException:
        close_inputs(fds)
        raise
    return fds


def close_inputs(fds: Sequence[int]) -> None:
    if isinstance(fds, LazyFds):
        fds.close()
        return
    for fd in fds:
        os.close(fd)


class LazyFds(Sequence[int]):
    """Input `i`'s descriptor, opened when first asked for; at most `cap` open, the least recently asked
    for closed first. The one a thread was last given stays open until that thread asks for another (the
    export's runner reads one input at a time in each thread), so no descriptor is closed under a read."""

    def __init__(self, paths: Sequence[str], cap: int) -> None:
        self.paths, self.cap = paths, cap
        self._open: OrderedDict[int, int] = OrderedDict()  # index -> descriptor, least recent first
        self._pinned: dict[int, int] = {}  # thread -> the index it was last given
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.paths)

    @overload
    def __getitem__(self, i: int) -> int: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[int]: ...
    def __getitem__(self, i: int | slice) -> int | Sequence[int]:
        if isinstance(i, slice):
            raise TypeError("LazyFds is read one input at a time")
        with self._lock:
            self._pinned[threading.get_ident()] = i
            fd = self._open.get(i)
            if fd is not None:
                self._open.move_to_end(i)
                return fd
            self._spare(self.cap - 1)
            try:
                fd = reopen.open_held(self.paths[i], FLAGS)
            except OSError as e:
                if e.errno not in (errno.EMFILE, errno.ENFILE) or not self._spare(0):
                    raise open_failed(e, e.filename or self.paths[i], ShardError) from None
                fd = _open(self.paths[i])  # the rest of the process took more than its margin
            self._open[i] = fd
            return fd

    def _spare(self, keep: int) -> bool:
        """Close the least recently asked for until `keep` are open (none a thread reads); whether any was."""
        pinned = set(self._pinned.values())
        n = max(0, len(self._open) - keep)
        spare = list(itertools.islice((k for k in self._open if k not in pinned), n))
        for k in spare:
            os.close(self._open.pop(k))
        return bool(spare)

    def close(self) -> None:
        with self._lock:
            for fd in self._open.values():
                os.close(fd)
            self._open.clear()


def _open(path: str) -> int:
    try:
        return reopen.open_held(path, FLAGS)
    except OSError as e:
        raise open_failed(e, e.filename or path, ShardError) from None


@functools.cache
def _room() -> None:
    raise_open_files_limit()
