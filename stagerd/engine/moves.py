"""Byte moves of a plan: direct runs (copy or cast) where they are long, else gathered slabs.

`plan_moves` streams them in destination order, one tensor's moves at a time, so running a plan holds one
tensor's moves however many tensors the checkpoint has.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Iterator, Sequence

from stagerd.contract import dtypes
from stagerd.engine import limits
from stagerd.engine.pack import Pack
from stagerd.engine.plan_types import Chunk, ExportPlan, Move, MoveKind, Piece, TensorPlan
from stagerd.engine.tiling import runs, strides
from stagerd.errors import PlanError


def tensor_moves(t: TensorPlan, data_start: int, where: str) -> list[Move]:
    """The moves that write `t` into its output file, whose data section starts at `data_start`.

    Raises `PlanError` where `t` cannot be moved byte by byte; `plan()` runs this for such dtypes so the
    error comes before any output."""
    sdt, ddt = dtypes.lookup(t.src_dtype), dtypes.lookup(t.dst_dtype)
    dst_base = data_start + t.begin
    live = [c for c in t.chunks if math.prod(c.shape) > 0]
    chunk_runs = [(c, *runs(c, t.shape)) for c in live]
    if sdt.bits % 8 and any(r > 1 or _strided(c) for c, r, _ in chunk_runs):
        raise PlanError(
            f"tensor {t.name!r}: {t.src_dtype} split inside its rows is not byte-addressable",
            path=where,
        )
    item = max(sdt.bits, ddt.bits) // 8
    if any(_strided(c) for c in live) or not all(
        r == 1 or ln * item >= limits.DIRECT_MIN_RUN for _, r, ln in chunk_runs
    ):
        return _gather_moves(t, dst_base, sdt, ddt)
    kind = MoveKind.COPY if sdt.name == ddt.name else MoveKind.CAST
    gstrides = strides(t.shape)
    moves: list[Move] = []
    for c, nruns, ln in chunk_runs:
        k = len(t.shape) - 1
        while k > 0 and c.shape[k] == t.shape[k]:
            k -= 1
        outer = c.shape[:k] if nruns > 1 else ()
        for i, idx in enumerate(_ndindex(outer)):
            dst_elem = sum(
                (o + (idx[d] if d < len(idx) else 0)) * s
                for d, (o, s) in enumerate(zip(c.global_offset, gstrides, strict=True))
            )
            moves.append(
                Move(
                    kind=kind,
                    file=t.file,
                    dst_offset=dst_base + ddt.nbytes(dst_elem),
                    length=ddt.nbytes(ln),
                    src=c.src,
                    src_offset=c.offset + sdt.nbytes(i * ln),
                    src_dtype=sdt.name,
                    dst_dtype=ddt.name,
                )
            )
    return moves


def _ndindex(shape: Sequence[int]) -> Iterable[tuple[int, ...]]:
    return itertools.product(*(range(n) for n in shape))


def _strided(c: Chunk) -> bool:
    """Whether `c`'s source layout is not row-major (a transposed block): strides that differ from its
    row-major ones on a dim longer than one."""
    if not c.strides:
        return False
    return any(n > 1 and s != r for n, s, r in zip(c.shape, c.strides, strides(c.shape), strict=True))


def _gather_moves(t: TensorPlan, dst_base: int, sdt: dtypes.DType, ddt: dtypes.DType) -> list[Move]:
    """Slabs of `t` along the outermost dim whose rows fit the buffer; one pwrite per slab."""
    g = t.shape
    item = max(sdt.bits, ddt.bits) // 8
    buffer = limits.BUFFER_BYTES
    p = 0
    while p < len(g) - 1 and math.prod(g[p + 1 :]) * item > buffer:
        p += 1
    row = math.prod(g[p + 1 :])
    rows_per_slab = max(1, buffer // max(1, row * item))
    gstrides = strides(g)
    live = [c for c in t.chunks if math.prod(c.shape) > 0]
    moves = []
    for prefix in _ndindex(g[:p]):
        owners = [
            c
            for c in live
            if all(c.global_offset[d] <= prefix[d] < c.global_offset[d] + c.shape[d] for d in range(p))
        ]
        for a in range(0, g[p], rows_per_slab):
            b = min(g[p], a + rows_per_slab)
            pieces = []
            for c in owners:
                lo, hi = max(a, c.global_offset[p]), min(b, c.global_offset[p] + c.shape[p])
                if lo >= hi:
                    continue
                ls = list(c.strides) if _strided(c) else strides(c.shape)
                src_elem = (
                    sum((prefix[d] - c.global_offset[d]) * ls[d] for d in range(p))
                    + (lo - c.global_offset[p]) * ls[p]
                )
                inner = ((c.global_offset[d], c.global_offset[d] + c.shape[d]) for d in range(p + 1, len(g)))
                box = ((lo - a, hi - a), *inner)
                start = c.offset + sdt.nbytes(src_elem)
                if not _strided(c):
                    pieces.append(Piece(c.src, start, sdt.nbytes((hi - lo) * ls[p]), box))
                    continue
                # the source bytes from the first element to the end of the last: what the piece reads
                last = sum((hi_ - lo_ - 1) * s for (lo_, hi_), s in zip(box, ls[p:], strict=True))
                byte_strides = tuple(sdt.nbytes(s) for s in ls[p:])
                pieces.append(Piece(c.src, start, sdt.nbytes(last + 1), box, byte_strides))
            dst_elem = sum(prefix[d] * gstrides[d] for d in range(p)) + a * gstrides[p]
            moves.append(
                Move(
                    kind=MoveKind.GATHER,
                    file=t.file,
                    dst_offset=dst_base + ddt.nbytes(dst_elem),
                    length=ddt.nbytes((b - a) * row),
                    src_dtype=sdt.name,
                    dst_dtype=ddt.name,
                    slab_shape=(b - a, *g[p + 1 :]),
                    pieces=tuple(pieces),
                )
            )
    return moves


def _in_order(p: ExportPlan) -> Iterator[Move]:
    """Every tensor's moves in destination order: runs of tiny tensors as one pack each (`engine/pack.py`),
    the others tensor by tensor."""
    where = p.chunks.where
    for fi, f in enumerate(p.files):
        pack = Pack(p, fi, f.header_size)
        for r in range(f.first, f.stop):
            taken = pack.take(r)
            if taken:
                continue
            if (m := pack.flush()) is not None:
                yield m
            if taken is False and pack.take(r):
                continue
            moves = tensor_moves(p.row(r, fi), f.header_size, where)
            moves.sort(key=lambda m: m.dst_offset)
            yield from moves
        if (m := pack.flush()) is not None:
            yield m


def plan_moves(p: ExportPlan) -> Iterator[Move]:
    """Every move of `p`, file by file in destination order: tiny tensors packed, tiny back-to-back copies
    coalesced, big runs split so threads share the work."""
    pending: Move | None = None
    for m in _in_order(p):
        if pending is not None and _mergeable(pending, m):
            pending = Move(
                MoveKind.COPY,
                m.file,
                pending.dst_offset,
                pending.length + m.length,
                m.src,
                pending.src_offset,
            )
            continue
        if pending is not None:
            yield from _split(pending)
        pending = m
    if pending is not None:
        yield from _split(pending)


def _mergeable(prev: Move, m: Move) -> bool:
    return (
        m.kind is prev.kind is MoveKind.COPY
        and m.file == prev.file
        and m.src == prev.src
        and prev.dst_offset + prev.length == m.dst_offset
        and prev.src_offset + prev.length == m.src_offset
        and prev.length + m.length <= limits.COPY_PIECE
    )


def _split(m: Move) -> Iterator[Move]:
    piece = limits.COPY_PIECE
    if m.kind is MoveKind.GATHER or m.length <= piece:
        yield m
        return
    sdt, ddt = dtypes.lookup(m.src_dtype or "U8"), dtypes.lookup(m.dst_dtype or "U8")
    step = piece - piece % 64  # whole elements of any byte-sized dtype
    for off in range(0, m.length, step):
        n = min(step, m.length - off)
        src_off = off if m.kind is MoveKind.COPY else off * sdt.bits // ddt.bits
        yield Move(
            m.kind, m.file, m.dst_offset + off, n, m.src, m.src_offset + src_off, m.src_dtype, m.dst_dtype
        )


def by_source(moves: Iterable[Move]) -> Iterator[Move]:
    """`moves` in batches of at most `limits.SOURCE_BATCH` moves or gather pieces (a pack holds up to
    `limits.PACK_PIECES`: what a batch holds as objects) and `limits.SOURCE_BATCH_BYTES` bytes,
    each batch's moves grouped by source file (a gather by its first piece's), in order within a file.

    For inputs beyond the descriptor budget: in destination order, a tensor gathered from every rank
    reads every file in turn, so keeping the most recently read open reopened a file for every piece.
    Grouped, each file is opened at most once a batch. Writes then land out of order within a batch,
    which the flusher takes (it tracks the written prefix), and a batch bounds what waits behind it."""
    batch: list[Move] = []
    size = items = 0
    for m in moves:
        batch.append(m)
        size += m.length
        items += max(1, len(m.pieces))
        if items >= limits.SOURCE_BATCH or size >= limits.SOURCE_BATCH_BYTES:
            batch.sort(key=_source)
            yield from batch
            batch.clear()
            size = items = 0
    batch.sort(key=_source)
    yield from batch


def _source(m: Move) -> int:
    return m.pieces[0].src if m.pieces else m.src
