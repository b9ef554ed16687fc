"""Tensor geometry: the chunks of a tensor tile it exactly once, and how a chunk lies in the output."""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence

import numpy as np

from stagerd.engine import limits
from stagerd.engine.plan_types import Chunk
from stagerd.errors import PlanError


def strides(shape: Sequence[int]) -> list[int]:
    out = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        out[d] = out[d + 1] * shape[d + 1]
    return out


def check_tiling(name: str, shape: tuple[int, ...], chunks: Sequence[Chunk], where: str) -> None:
    """The chunks cover the tensor exactly once: no gap, no overlap, nothing out of bounds."""
    live = [c for c in chunks if math.prod(c.shape) > 0]
    for c in live:
        for d, (o, n, g) in enumerate(zip(c.global_offset, c.shape, shape, strict=True)):
            if o + n > g:
                raise PlanError(
                    f"tensor {name!r}: chunk at {list(c.global_offset)} runs past dim {d} ({g})", path=where
                )
    total = math.prod(shape)
    covered = sum(math.prod(c.shape) for c in live)
    if covered != total:
        kind = "overlap" if covered > total else "do not cover it (a shard is missing?)"
        raise PlanError(
            f"tensor {name!r}{list(shape)}: its chunks {kind}: {covered} of {total} elements", path=where
        )
    if len(live) <= 1:
        return
    bounds = [
        sorted({0, g, *(c.global_offset[d] for c in live), *(c.global_offset[d] + c.shape[d] for c in live)})
        for d, g in enumerate(shape)
    ]
    cells = math.prod(len(b) - 1 for b in bounds)
    if cells <= limits.MAX_GRID_CELLS:
        grid = np.zeros([len(b) - 1 for b in bounds], dtype=np.int32)
        for c in live:
            sl = tuple(
                slice(bisect.bisect_left(b, o), bisect.bisect_left(b, o + n))
                for b, o, n in zip(bounds, c.global_offset, c.shape, strict=True)
            )
            grid[sl] += 1
        if (grid > 1).any():
            raise PlanError(f"tensor {name!r}: chunks overlap", path=where)
        return
    for i, a in enumerate(live):  # pathological non-grid tilings only
        for b in live[i + 1 :]:
            if all(
                oa < ob + nb and ob < oa + na
                for oa, na, ob, nb in zip(a.global_offset, a.shape, b.global_offset, b.shape, strict=True)
            ):
                raise PlanError(f"tensor {name!r}: chunks overlap", path=where)


def tiles_simply(boxes: Sequence[tuple[Sequence[int], Sequence[int]]], shape: Sequence[int]) -> bool:
    """Whether the blocks `boxes` ((global offset, shape) each) tile `shape` in the way nearly every
    checkpoint does: one whole block, or non-empty blocks that span every dimension but one and lie back
    to back along it from 0 to its end. False says only "not simply": `check_tiling` then decides (and
    names what is wrong)."""
    if 0 in shape:
        return False
    if len(boxes) == 1:
        off, n = boxes[0]
        return not any(off) and list(n) == list(shape)
    split = -1
    spans: list[tuple[int, int]] = []
    for off, n in boxes:
        for d, g in enumerate(shape):
            if off[d] == 0 and n[d] == g:
                continue
            if split not in (-1, d):
                return False
            split = d
        if split < 0 or 0 in n:
            return False
        spans.append((off[split], off[split] + n[split]))
    spans.sort()
    pos = 0
    for lo, hi in spans:
        if lo != pos:
            return False
        pos = hi
    return pos == shape[split]


def runs(chunk: Chunk, shape: tuple[int, ...]) -> tuple[int, int]:
    """(number of contiguous destination runs, elements per run) of a chunk."""
    n = len(shape)
    k = -1
    for d in range(n - 1, -1, -1):
        if chunk.shape[d] != shape[d]:
            k = d
            break
    if k <= 0 or all(chunk.shape[d] == 1 for d in range(k)):
        return 1, math.prod(chunk.shape)
    return math.prod(chunk.shape[:k]), math.prod(chunk.shape[k:])
