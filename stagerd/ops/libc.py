"""libc functions that `os` lacks (`sync_file_range`, `preadv` into raw iovec arrays), loaded once per
process: `ctypes.util.find_library` runs `ldconfig` in a subprocess each time it is called."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from collections.abc import Callable
from typing import Any

SYNC_FILE_RANGE_WAIT_BEFORE, SYNC_FILE_RANGE_WRITE, SYNC_FILE_RANGE_WAIT_AFTER = 1, 2, 4
# Write the range and wait until it is on disk, waiting first for writeback already under way on it.
SYNC_FILE_RANGE_DURABLE = SYNC_FILE_RANGE_WAIT_BEFORE | SYNC_FILE_RANGE_WRITE | SYNC_FILE_RANGE_WAIT_AFTER


@functools.cache
def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None


def _function(name: str, argtypes: list[Any], restype: Any) -> Callable[..., int] | None:
    fn = getattr(_libc(), name, None)
    if fn is None:
        return None
    fn.argtypes, fn.restype = argtypes, restype
    return fn


@functools.cache
def sync_file_range() -> Callable[[int, int, int, int], int] | None:
    """(fd, offset, nbytes, flags); None without it (writeback is then left to fsync)."""
    return _function(
        "sync_file_range", [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint], ctypes.c_int
    )


@functools.cache
def preadv() -> Callable[[int, int, int, int], int] | None:
    """(fd, address of an iovec array, its length, offset); None without it."""
    return _function(
        "preadv", [ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int64], ctypes.c_ssize_t
    )
