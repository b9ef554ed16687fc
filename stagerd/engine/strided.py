"""Tile-wise moves of strided blocks (transposed views) into a gather's slab: read, then place.

A strided piece (`Piece.strides`) names a box of the slab and where each of its elements lies in the
source. `read_pieces` reads it into the scratch buffer in as few `pread`s as its layout allows:

- dense (the piece's source span at most `DENSE` times its bytes): the span itself, in bands along its
  outermost source dim that fit the scratch buffer;
- sparse (a thin strip of a big block, as one slab of a big transpose is): run by run, the runs (along
  the source's contiguous dim) packed one after another, so nothing between them is read (one `pread`
  each, looped in C by `_tiles.read_runs`).

`place` then copies each read into the slab box: numpy where both sides run along the same dim, and
`_tiles.copy2d` (C, tile by tile, GIL released) where they do not (a transpose), one call per 2-D face.
Without the compiled module the faces are copied by numpy in square tiles: the same bytes, slower.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import numpy as np

from stagerd.engine.iov import pread_into
from stagerd.engine.plan_types import Piece

try:
    from stagerd.engine import _tiles
except ImportError:  # built without a C compiler (setup.py marks the extension optional)
    _tiles = None  # type: ignore[assignment]

DENSE = 4  # read a span whole while it holds at least a quarter of useful bytes
MIN_RUN = 512  # shorter runs are read with what lies between them: a pread each would cost more
_NP_TILE = 256  # the numpy fallback's square tiles


class Read:
    """Elements of box `shape` (a sub-box of the piece's at `at`) in `scratch`, at byte `offset` and
    byte `strides` per dim."""

    __slots__ = ("at", "offset", "shape", "strides")

    def __init__(self, at: tuple[int, ...], shape: tuple[int, ...], offset: int, strides: tuple[int, ...]):
        self.at, self.shape, self.offset, self.strides = at, shape, offset, strides


def read_piece(fd: int, path: str, pc: Piece, isz: int, scratch: memoryview) -> Iterator[Read]:
    """Read strided piece `pc` into `scratch`, one `Read` at a time (each is placed before the next)."""
    shape = tuple(hi - lo for lo, hi in pc.box)
    yield from _reads(fd, path, pc.src_offset, shape, pc.strides, isz, scratch, (0,) * len(shape))


def _span(shape: Sequence[int], strides: Sequence[int], isz: int) -> int:
    return sum((n - 1) * s for n, s in zip(shape, strides, strict=True)) + isz


def _reads(
    fd: int,
    path: str,
    offset: int,
    shape: tuple[int, ...],
    strides: tuple[int, ...],
    isz: int,
    scratch: memoryview,
    at: tuple[int, ...],
) -> Iterator[Read]:
    if math.prod(shape) == 0:
        return
    useful, span = math.prod(shape) * isz, _span(shape, strides, isz)
    outer = [d for d in sorted(range(len(shape)), key=lambda d: -strides[d]) if shape[d] > 1]
    inner = outer.pop() if outer else -1
    run = shape[inner] * isz if inner >= 0 and strides[inner] == isz else isz
    if span <= len(scratch) and (span <= DENSE * useful or run < MIN_RUN):
        pread_into(fd, scratch[:span], offset, path)
        yield Read(at, shape, 0, strides)
        return
    if run >= MIN_RUN and useful <= len(scratch):
        yield _packed_runs(fd, path, offset, shape, strides, isz, scratch, at, outer, inner)
        return
    # Too big for the buffer at once (or sparse with short runs): bands along the outermost source dim,
    # or pieces of the one run.
    d = outer[0] if outer else inner
    rest = list(shape)
    rest[d] = 1
    h = max(1, (len(scratch) - _span(rest, strides, isz)) // strides[d] + 1)
    for i in range(0, shape[d], h):
        sub = list(shape)
        sub[d] = min(h, shape[d] - i)
        where = list(at)
        where[d] += i
        yield from _reads(fd, path, offset + i * strides[d], tuple(sub), strides, isz, scratch, tuple(where))


def _packed_runs(
    fd: int,
    path: str,
    offset: int,
    shape: tuple[int, ...],
    strides: tuple[int, ...],
    isz: int,
    scratch: memoryview,
    at: tuple[int, ...],
    outer: list[int],
    inner: int,
) -> Read:
    """Each run along `inner` read into the next place of `scratch`: the packed block is row-major over
    the dims in source order (`outer`, then `inner`)."""
    run = shape[inner] * isz
    starts = np.zeros(1, dtype=np.int64)
    for d in outer:  # source order: the last of these varies fastest
        starts = (starts[:, None] + np.arange(shape[d], dtype=np.int64)[None, :] * strides[d]).ravel()
    starts += offset
    done = 0 if _tiles is None else _tiles.read_runs(fd, scratch, starts.tobytes(), run)
    for k, s in enumerate(starts[done:].tolist(), done):  # without the C loop, or the rest of a short one
        pread_into(fd, scratch[k * run : (k + 1) * run], s, path)
    packed = [0] * len(shape)
    step = run
    packed[inner] = isz
    for d in reversed(outer):
        packed[d] = step
        step *= shape[d]
    return Read(at, shape, 0, tuple(packed))


def place(
    dst: memoryview,
    dst_offset: int,
    dst_strides: Sequence[int],
    src: memoryview,
    src_offset: int,
    src_strides: Sequence[int],
    shape: Sequence[int],
    isz: int,
) -> None:
    """Copy the elements of `shape` at `src_strides` from `src_offset` into `dst` at `dst_strides`."""
    dims = [d for d, n in enumerate(shape) if n > 1]
    if not dims:
        dst[dst_offset : dst_offset + isz] = src[src_offset : src_offset + isz]
        return
    sh = [shape[d] for d in dims]
    ds, ss = [dst_strides[d] for d in dims], [src_strides[d] for d in dims]
    j = next((k for k in reversed(range(len(dims))) if ds[k] == isz), -1)  # where dst runs
    i = next((k for k in reversed(range(len(dims))) if ss[k] == isz), -1)  # where src runs
    kind = np.dtype(f"u{isz}") if isz in (1, 2, 4, 8) else np.dtype((np.void, isz))
    if i < 0 or j < 0 or i == j:  # no transpose: numpy's loops run along both sides' runs
        d_arr = np.ndarray(sh, kind, dst, dst_offset, ds)
        d_arr[...] = np.ndarray(sh, kind, src, src_offset, ss)
        return
    rest = [k for k in range(len(dims)) if k not in (i, j)]
    for idx in np.ndindex(*(sh[k] for k in rest)):
        so = src_offset + sum(n * ss[k] for n, k in zip(idx, rest, strict=True))
        do = dst_offset + sum(n * ds[k] for n, k in zip(idx, rest, strict=True))
        if _tiles is not None:
            _tiles.copy2d(src, so, ss[i], ss[j], dst, do, ds[i], ds[j], sh[i], sh[j], isz)
            continue
        d_face = np.ndarray((sh[i], sh[j]), kind, dst, do, (ds[i], ds[j]))
        s_face = np.ndarray((sh[i], sh[j]), kind, src, so, (ss[i], ss[j]))
        for a in range(0, sh[i], _NP_TILE):
            for b in range(0, sh[j], _NP_TILE):
                d_face[a : a + _NP_TILE, b : b + _NP_TILE] = s_face[a : a + _NP_TILE, b : b + _NP_TILE]
