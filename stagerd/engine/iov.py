"""Reads from the source shards: `pread_into` (a whole buffer, truncation a named error) and scatter reads,
one contiguous source range into many equal segments of a buffer by `preadv`, with the iovec array built
by numpy instead of one Python buffer object per segment.

A `Shard(1)` slab's piece is thousands of row segments of a few KiB: `os.preadv` takes a Python object per
segment (slicing and buffer export cost about as much as the copy itself at 1 KiB); here the segments'
addresses are one vectorised sum, and libc's preadv is called through ctypes (which releases the GIL).
Without libc's preadv the same reads go through `os.preadv`.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Sequence

import numpy as np

from stagerd.engine import limits
from stagerd.errors import ShardError
from stagerd.ops import libc

_PREADV = libc.preadv()


def address(buf: bytearray) -> int:
    """The address of `buf`'s bytes (which stay put: a bytearray with an export cannot be resized)."""
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


def scatter_read(
    fd: int, buf: bytearray, offsets: Sequence[int] | np.ndarray, seg: int, src_offset: int, path: str
) -> None:
    """Read `len(offsets) * seg` bytes from `fd` at `src_offset` into `buf`, segment k at `offsets[k]`."""
    offs = np.asarray(offsets, dtype=np.int64)
    if len(offs) and (offs.min() < 0 or offs.max() + seg > len(buf)):
        raise ValueError("scatter_read: a segment lies outside the buffer")
    if _PREADV is None:
        view = memoryview(buf)
        _finish(fd, [view[o : o + seg] for o in offs.tolist()], src_offset, path)
        return
    iov = np.empty((len(offs), 2), dtype=np.uint64)
    iov[:, 0] = offs.astype(np.uint64) + np.uint64(address(buf))
    iov[:, 1] = seg
    for i in range(0, len(offs), limits.IOV_MAX):
        n = min(limits.IOV_MAX, len(offs) - i)
        want = n * seg
        got = _PREADV(fd, iov[i : i + n].ctypes.data, n, src_offset)
        if got < 0:
            e = ctypes.get_errno()
            raise OSError(e, os.strerror(e), path)
        if got < want:  # short read: finish segment by segment, so truncation is still caught
            view = memoryview(buf)
            segs = [view[o : o + seg] for o in offs[i : i + n].tolist()]
            _finish(fd, segs, src_offset, path, skip=got)
        src_offset += want


def gather_read(
    fd: int, buf: bytearray, offsets: Sequence[int], lengths: Sequence[int], src_offset: int, path: str
) -> None:
    """Read `sum(lengths)` contiguous bytes from `fd` at `src_offset` into `buf`, the k-th `lengths[k]`
    of them at `offsets[k]`: a pack's back-to-back source runs, one `preadv` per `limits.IOV_MAX`."""
    offs = np.asarray(offsets, dtype=np.int64)
    lens = np.asarray(lengths, dtype=np.int64)
    if len(offs) and ((offs < 0).any() or (offs + lens).max() > len(buf) or (lens < 0).any()):
        raise ValueError("gather_read: a segment lies outside the buffer")
    if _PREADV is None:
        view = memoryview(buf)
        _finish(
            fd, [view[o : o + n] for o, n in zip(offs.tolist(), lens.tolist(), strict=True)], src_offset, path
        )
        return
    iov = np.empty((len(offs), 2), dtype=np.uint64)
    iov[:, 0] = offs.astype(np.uint64) + np.uint64(address(buf))
    iov[:, 1] = lens.astype(np.uint64)
    for i in range(0, len(offs), limits.IOV_MAX):
        n = min(limits.IOV_MAX, len(offs) - i)
        want = int(lens[i : i + n].sum())
        got = _PREADV(fd, iov[i : i + n].ctypes.data, n, src_offset)
        if got < 0:
            e = ctypes.get_errno()
            raise OSError(e, os.strerror(e), path)
        if got < want:  # short read: finish segment by segment, so truncation is still caught
            view = memoryview(buf)
            segs = [
                view[o : o + k]
                for o, k in zip(offs[i : i + n].tolist(), lens[i : i + n].tolist(), strict=True)
            ]
            _finish(fd, segs, src_offset, path, skip=got)
        src_offset += want


def pread_into(fd: int, view: memoryview, offset: int, path: str) -> None:
    """Fill `view` from `fd` at `offset`; a file that ends first is a `ShardError`, not a short buffer."""
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise ShardError(f"ends early at byte {offset + done} (truncated while reading?)", path=path)
        done += n


def _finish(fd: int, views: list[memoryview], offset: int, path: str, skip: int = 0) -> None:
    """Read `views` from `offset` on, the first `skip` bytes already read."""
    pos = 0
    for v in views:
        if pos + len(v) > skip:
            done = max(0, skip - pos)
            pread_into(fd, v[done:], offset + pos + done, path)
        pos += len(v)
