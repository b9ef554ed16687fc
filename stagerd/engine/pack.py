"""Tiny tensors packed into one gather move: a run of whole tensors, back to back in one output file,
assembled in one buffer from their source runs and written (or compared) with one pwrite.

A move costs tens of microseconds of Python (a thread hand-off, a syscall, the flusher's bookkeeping)
whatever its size, so at 100k tensors of a few KiB one move per block made the export per-move bound.
A pack is an ordinary `GATHER` move whose slab is the pack's bytes as one row of elements (`slab_shape ==
(n,)`): each piece places one source block's contiguous bytes at `box[0]`, or, for a block split inside
its rows (`Shard(1)`), as `rows` evenly spaced runs from there. Its pieces are listed in source order,
so the runner reads each stretch of back-to-back runs with one `preadv` (`iov.gather_read`).

Only what a one-row slab can say is packed: byte-sized dtypes, row-major blocks (no transposed view),
and few pieces per tensor; anything else keeps its own moves (`moves.tensor_moves`).
"""

from __future__ import annotations

import itertools
import math

from stagerd.contract import dtypes
from stagerd.engine import limits
from stagerd.engine.plan_types import DTYPE_NAMES, ExportPlan, Move, MoveKind, Piece
from stagerd.engine.tiling import strides

_BITS = tuple(dtypes.lookup(name).bits for name in DTYPE_NAMES)


class Pack:
    """The pack being filled for one output file: tensors are added in row order while they fit."""

    def __init__(self, p: ExportPlan, file: int, data_start: int) -> None:
        self.p, self.file, self.data_start = p, file, data_start
        # src, src offset, bytes, slab lo, hi of the first run, runs, elements from one run to the next
        self.pieces: list[tuple[int, int, int, int, int, int, int]] = []
        self.begin = self.end = 0  # the pack's data-section byte range
        self.n = 0  # slab elements so far
        self.pair = (-1, -1)  # (source, output) dtype codes

    def take(self, r: int) -> bool | None:
        """Add row `r` if it is packable and fits: True; False if it is packable but the pack must be
        flushed first (then `take` again); None if it is not packable at all."""
        p = self.p
        t = p.tensor[r]
        begin, end = p.begin[r], p.end[r]
        if end - begin > limits.PACK_TENSOR:
            return None
        pair = (p.chunks.dtype[t], p.dst_dtype[r])
        sbits, dbits = _BITS[pair[0]], _BITS[pair[1]]
        elems, wide = (end - begin) * 8 // max(dbits, 1), max(sbits, dbits) // 8
        if sbits % 8 or dbits % 8 or elems * wide > limits.BUFFER_BYTES:
            return None
        runs = _runs(p, t, sbits // 8)
        if runs is None:
            return None
        if self.pieces or self.n:
            fits = (
                pair == self.pair
                and begin == self.end
                and (self.n + elems) * wide <= limits.BUFFER_BYTES
                and len(self.pieces) + len(runs) <= limits.PACK_PIECES
            )
            if not fits:
                return False
        else:
            self.pair, self.begin, self.end = pair, begin, begin
        base, isz = self.n, sbits // 8
        for src, src_offset, lo, ln, count, step in runs:
            self.pieces.append((src, src_offset, ln * count * isz, base + lo, base + lo + ln, count, step))
        self.n += elems
        self.end = end
        return True

    def flush(self) -> Move | None:
        """The pack's move (None if it has no bytes), and an empty pack."""
        if self.end == self.begin:
            self.pieces.clear()
            return None
        self.pieces.sort()
        sdt, ddt = (DTYPE_NAMES[c] for c in self.pair)
        m = Move(
            kind=MoveKind.GATHER,
            file=self.file,
            dst_offset=self.data_start + self.begin,
            length=self.end - self.begin,
            src_dtype=sdt,
            dst_dtype=ddt,
            slab_shape=(self.n,),
            pieces=tuple(
                Piece(s, off, ln, ((lo, hi),), (), (count, step))
                for s, off, ln, lo, hi, count, step in self.pieces
            ),
        )
        self.pieces.clear()
        self.begin = self.end
        self.n = 0
        return m


def _runs(p: ExportPlan, t: int, isz: int) -> list[tuple[int, int, int, int, int, int]] | None:
    """(source, source byte offset, first element in the tensor, elements a run, runs, elements from one
    run to the next) of each source block of tensor `t` (`isz` bytes an element at the source), a block
    whose runs are not evenly spaced given run by run; None where `t` is not packable: a transposed
    block, or more than `limits.PACK_RUNS` entries."""
    c_ = p.chunks
    dims, order, strided = c_.dims, c_.order, c_.strided
    shape = p.shape(t)
    nd = len(shape)
    out: list[tuple[int, int, int, int, int, int]] = []
    for i in range(c_.first[t], c_.first[t + 1]):
        c = order[i]
        if strided and c in strided:
            return None
        at = c_.at[c]
        cs = dims[at + nd : at + 2 * nd]
        n = math.prod(cs)
        if n == 0:
            continue
        start = 0  # the block's first element, row-major in the tensor (Horner's rule)
        for o, g in zip(dims[at : at + nd], shape, strict=True):
            start = start * g + o
        k = nd - 1
        while k > 0 and cs[k] == shape[k]:
            k -= 1
        outer = [d for d in range(k) if cs[d] > 1]
        if k <= 0 or not outer:
            out.append((c_.src[c], c_.offset[c], start, n, 1, 0))
            continue
        ln = math.prod(cs[k:])
        gs = strides(shape)
        if len(outer) == 1:  # evenly spaced: one entry
            out.append((c_.src[c], c_.offset[c], start, ln, n // ln, gs[outer[0]]))
            continue
        if len(out) + n // ln > limits.PACK_RUNS:
            return None
        src, at_src = c_.src[c], c_.offset[c]
        for j, idx in enumerate(itertools.product(*(range(x) for x in cs[:k]))):
            elem = start + sum(i_ * s for i_, s in zip(idx, gs, strict=False))
            out.append((src, at_src + j * ln * isz, elem, ln, 1, 0))
    return out if len(out) <= limits.PACK_RUNS else None
