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
