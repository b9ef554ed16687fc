"""Carry out a to-Hub plan (`contract/hub_plan.py`) on the chunk table, before the export is planned.

Every output tensor is a box of one staged tensor. Each staged block that meets the box is cut into the
runs of it that are contiguous in its shard file (the box is full in every dim after the run's), and
each run becomes a block of the output tensor at its place in the output. The table that comes out
describes the Hub names and shapes with blocks that are plain byte ranges of the same shard files, so the
planner, its tiling, copy, cast and gather moves, and their bounded buffers carry the conversion out
unchanged: no tensor is ever held whole, and the bytes move at copy speed.

Parts of one output (a concatenation or stack: several views of one name, each placed `at` its offset)
are cut the same way and shifted to their place.

A permuted view (`reshape` + `perm`, the RoPE row order) is cut into runs along the dims after its last
permuted one (whole rows for RoPE); each run, within each block, is placed as the boxes that tile its
range of the output. Where the last dim itself moves (a transpose), each block's part inside the box is
one strided block of the output (`Chunk.strides`: the source strides of the dims it became): the planner
gathers it into bounded slabs, and the runner moves it tile-wise (`engine/strided.py`), never element by
element and never the whole tensor.
"""

from __future__ import annotations

import itertools
import math
from array import array
from collections.abc import Callable, Iterator, Mapping

from stagerd.contract import dtypes
from stagerd.contract.hub_plan import HubPlan, TensorView, moves_by_lines
from stagerd.engine.chunk_table import freeze_table
from stagerd.engine.plan_types import Chunk, ChunkTable
from stagerd.engine.tiling import strides
from stagerd.errors import HubPlanError

# (source, byte offset, offset and shape in the output, source strides in elements or () for row-major)
Piece = tuple[int, int, tuple[int, ...], tuple[int, ...], tuple[int, ...]]


def apply_views(
    table: ChunkTable, ids: Mapping[str, int], shape: Callable[[int], tuple[int, ...]], hub: HubPlan
) -> tuple[ChunkTable, dict[str, int]]:
    """The chunk table of the plan's output tensors, and their name -> id."""
    where = table.where
    outputs = hub.outputs({n: shape(t) for n, t in ids.items()}, path=where)
    out_ids: dict[str, int] = {}
    blob, name_end, dtype = bytearray(), array("q"), array("B")
    tensor, src, offset, at, ndim, dims = (array(c) for c in ("i", "i", "q", "q", "B", "q"))
    strided: dict[int, tuple[int, ...]] = {}
    for v in outputs:
        t = ids[v.source]
        dt = dtypes.lookup(table.dtype_name(t))
        if dt.bits % 8 and not v.is_whole(shape(t)):
            raise HubPlanError(
                f"view {v.name!r}: {dt.name} is not byte-addressable inside a tensor", path=where
            )
        o = out_ids.setdefault(v.name, len(out_ids))
        if o == len(name_end):
            blob += v.name.encode()
            name_end.append(len(blob))
            dtype.append(table.dtype[t])
        elif dtype[o] != table.dtype[t]:  # a part of a concatenation
            raise HubPlanError(f"{v.name!r}: its parts are of different dtypes", path=where)
        chunks = table.chunks_of(t)
        pieces = list(_permuted(chunks, v, dt)) if v.perm else [p for c in chunks for p in _pieces(c, v, dt)]
        if not pieces:  # an empty tensor: one empty block gives it its shape
            pieces = [(table.chunks_of(t)[0].src, 0, (0,) * len(v.shape), tuple(v.shape), ())]
        for s, off, go, sh, st in pieces:
            if v.at:  # a part of a concatenation: placed at its offset in the whole
                go = tuple(a + b for a, b in zip(go, v.at, strict=True))
            if st:
                strided[len(tensor)] = st
            tensor.append(o)
            src.append(s)
            offset.append(off)
            at.append(len(dims))
            ndim.append(len(go))
            dims.extend(go)
            dims.extend(sh)
    new = freeze_table(table.sources, blob, name_end, dtype, tensor, src, offset, at, ndim, dims, strided)
    return new, out_ids


def _pieces(c: Chunk, v: TensorView, dt: dtypes.DType) -> Iterator[Piece]:
    """(source, byte offset, offset and shape in the output, no strides) of each run of `c` in `v`'s box."""
    nd = len(c.shape)
    lo = [max(c.global_offset[d], v.start[d]) for d in range(nd)]
    hi = [min(c.global_offset[d] + c.shape[d], v.start[d] + v.size[d]) for d in range(nd)]
    if any(a >= b for a, b in zip(lo, hi, strict=True)) or math.prod(c.shape) == 0:
        return
    # k: the outermost dim from which on the intersection is full in the chunk; one run per index above it.
    k = nd - 1 if nd else 0
    while k > 0 and hi[k] - lo[k] == c.shape[k]:
        k -= 1
    cs = strides(c.shape)
    keep = [d for d in range(nd) if v.size[d] != 1]  # box dims that are output dims, in order
    out_dims = [j for j, n in enumerate(v.shape) if n != 1]
    for prefix in itertools.product(*(range(lo[d], hi[d]) for d in range(min(k, nd)))):
        g = [*prefix, *lo[len(prefix) :]]
        sh = [*(1 for _ in prefix), *(hi[d] - lo[d] for d in range(len(prefix), nd))]
        elem = sum((g[d] - c.global_offset[d]) * cs[d] for d in range(nd))
        go, osh = [0] * len(v.shape), [1] * len(v.shape)
        for j, d in zip(out_dims, keep, strict=True):
            go[j], osh[j] = g[d] - v.start[d], sh[d]
        yield c.src, c.offset + dt.nbytes(elem), tuple(go), tuple(osh), ()


def _range_boxes(
    o: int, n: int, shape: tuple[int, ...]
) -> Iterator[tuple[int, tuple[int, ...], tuple[int, ...]]]:
    """(flat offset, start, size) of the boxes that tile the row-major range [o, o + n) of `shape`."""
    if n <= 0:
        return
    if len(shape) <= 1:
        yield o, (o,) if shape else (), (n,) if shape else ()
        return
    inner = math.prod(shape[1:])
    i, r = divmod(o, inner)
    if r:
        take = min(n, inner - r)
        for f, st, sz in _range_boxes(r, take, shape[1:]):
            yield i * inner + f, (i, *st), (1, *sz)
        o, n, i = o + take, n - take, i + 1
    full = n // inner
    if full:
        yield o, (i, *(0 for _ in shape[1:])), (full, *shape[1:])
        o, n, i = o + full * inner, n - full * inner, i + full
    if n:
        for f, st, sz in _range_boxes(0, n, shape[1:]):
            yield i * inner + f, (i, *st), (1, *sz)


def _permuted(chunks: list[Chunk], v: TensorView, dt: dtypes.DType) -> Iterator[Piece]:
    """The pieces of a permuted view: runs of the dims after the last permuted one, block by block."""
    shape_r, perm = v.reshape, v.perm
    k = len(perm)
    while k > 0 and perm[k - 1] == k - 1:
        k -= 1
    if k == len(perm):  # the last dim moves: a transpose by source lines, else element by element
        yield from (_transposed(chunks, v, dt) if moves_by_lines(v) else _elements(chunks, v, dt))
        return
    run = math.prod(shape_r[k:])
    rs = strides(shape_r)
    outer = [shape_r[perm[j]] for j in range(k)]
    for i, q in enumerate(itertools.product(*(range(n) for n in outer))):
        b = sum(q[j] * rs[perm[j]] for j in range(k))  # where run i starts in the box, row-major
        for f, st, sz in _range_boxes(b, run, v.size):
            start = tuple(a + s for a, s in zip(v.start, st, strict=True))
            for c in chunks:
                yield from _box_pieces(c, start, sz, i * run + f - b, v.shape, dt)


def _box_pieces(
    c: Chunk,
    start: tuple[int, ...],
    size: tuple[int, ...],
    out: int,
    out_shape: tuple[int, ...],
    dt: dtypes.DType,
) -> Iterator[Piece]:
    """Runs of `c` inside the source box `start`/`size`, contiguous in both, whose box is the output range
    starting at `out`; each placed as the output boxes that tile its range."""
    nd = len(c.shape)
    lo = [max(c.global_offset[d], start[d]) for d in range(nd)]
    hi = [min(c.global_offset[d] + c.shape[d], start[d] + size[d]) for d in range(nd)]
    if any(a >= b for a, b in zip(lo, hi, strict=True)):
        return
    k = nd - 1 if nd else 0
    while k > 0 and hi[k] - lo[k] == c.shape[k] == size[k]:
        k -= 1
    cs, bs = strides(c.shape), strides(size)
    for prefix in itertools.product(*(range(lo[d], hi[d]) for d in range(min(k, nd)))):
        g = [*prefix, *lo[len(prefix) :]]
        n = math.prod(hi[d] - lo[d] for d in range(len(prefix), nd))
        elem = sum((g[d] - c.global_offset[d]) * cs[d] for d in range(nd))
        at = out + sum((g[d] - start[d]) * bs[d] for d in range(nd))
        for f, ost, osz in _range_boxes(at, n, out_shape):
            yield c.src, c.offset + dt.nbytes(elem + f - at), ost, osz, ()


def _transposed(chunks: list[Chunk], v: TensorView, dt: dtypes.DType) -> Iterator[Piece]:
    """A view that permutes its box's dims (a transpose): each block's part inside the box is one block of
    the output, with the source strides of the dims its dims came from."""
    nd = len(v.size)
    box_dims = [d for d in range(nd) if v.size[d] != 1]
    out_dims = [j for j, n in enumerate(v.shape) if n != 1]
    # output dim out_dims[i] <- box dim box_dims[perm[i]]
    src_of_out = {out_dims[i]: box_dims[p] for i, p in enumerate(v.perm)}
    for c in chunks:
        lo = [max(c.global_offset[d], v.start[d]) for d in range(nd)]
        hi = [min(c.global_offset[d] + c.shape[d], v.start[d] + v.size[d]) for d in range(nd)]
        if any(a >= b for a, b in zip(lo, hi, strict=True)):
            continue
        cs = strides(c.shape)
        elem = sum((lo[d] - c.global_offset[d]) * cs[d] for d in range(nd))
        go, sh, st = [0] * len(v.shape), [1] * len(v.shape), [0] * len(v.shape)
        for j, d in src_of_out.items():
            go[j], sh[j], st[j] = lo[d] - v.start[d], hi[d] - lo[d], cs[d]
        yield c.src, c.offset + dt.nbytes(elem), tuple(go), tuple(sh), tuple(st)


def _elements(chunks: list[Chunk], v: TensorView, dt: dtypes.DType) -> Iterator[Piece]:
    """A permutation that moves single elements (RoPE's row order on a bias): one piece per element of
    the output, in its order; `check_box` bounds how many (MAX_ELEMENT_MOVES)."""
    nd = len(v.size)
    permuted = [v.reshape[p] for p in v.perm]
    rs, bs = strides(v.reshape), strides(v.size)
    one = (1,) * len(v.shape)
    for j in range(math.prod(v.size)):
        q = _unravel(j, permuted)
        b = sum(q[i] * rs[p] for i, p in enumerate(v.perm))  # its place in the box, row-major
        g = [v.start[d] + (b // bs[d]) % v.size[d] for d in range(nd)]
        c = next(c for c in chunks if all(0 <= g[d] - c.global_offset[d] < c.shape[d] for d in range(nd)))
        elem = sum((g[d] - c.global_offset[d]) * s for d, s in enumerate(strides(c.shape)))
        yield c.src, c.offset + dt.nbytes(elem), tuple(_unravel(j, v.shape)), one, ()


def _unravel(i: int, shape: list[int] | tuple[int, ...]) -> list[int]:
    return [(i // s) % n for s, n in zip(strides(shape), shape, strict=True)]
