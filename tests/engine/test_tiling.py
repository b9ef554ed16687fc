"""`tiles_simply`, the planner's fast check of the common tilings, never passes what `check_tiling` refuses,
and passes the layouts DCP writes (whole, or split along one dimension in any order)."""

from __future__ import annotations

import random

import pytest

from stagerd.engine.plan_types import Chunk
from stagerd.engine.tiling import check_tiling, tiles_simply
from stagerd.errors import PlanError


def _valid(shape, boxes) -> bool:
    chunks = [Chunk(0, 0, tuple(o), tuple(n)) for o, n in boxes]
    try:
        check_tiling("t", tuple(shape), chunks, ".")
    except PlanError:
        return False
    return True


@pytest.mark.parametrize(
    ("shape", "boxes", "simple"),
    [
        ((4, 6), [((0, 0), (4, 6))], True),
        ((), [((), ())], True),
        ((4, 6), [((2, 0), (2, 6)), ((0, 0), (2, 6))], True),  # shards listed out of order
        ((4, 6), [((0, 0), (4, 3)), ((0, 3), (4, 3))], True),  # Shard(1)
        ((4, 6), [((0, 0), (2, 3)), ((0, 3), (2, 3)), ((2, 0), (2, 6))], False),  # 2-D: check_tiling decides
        ((4, 6), [((0, 0), (3, 6)), ((2, 0), (2, 6))], False),  # overlap
        ((4, 6), [((0, 0), (1, 6)), ((2, 0), (2, 6))], False),  # gap
        ((4, 6), [((0, 0), (4, 6)), ((0, 0), (4, 6))], False),  # twice whole
        ((4, 6), [((1, 0), (3, 6))], False),  # one block, not at 0
        ((0, 6), [((0, 0), (0, 6))], False),  # empty: check_tiling decides
        ((4, 6), [((0, 0), (0, 6)), ((0, 0), (4, 6))], False),  # an empty block beside
    ],
)
def test_known_layouts(shape, boxes, simple):
    assert tiles_simply(boxes, shape) is simple
    if simple:
        assert _valid(shape, boxes)


def test_never_passes_what_check_tiling_refuses():
    rng = random.Random(7)
    seen = 0
    for _ in range(3000):
        nd = rng.randint(1, 3)
        shape = [rng.randint(1, 4) for _ in range(nd)]
        boxes = []
        for _ in range(rng.randint(1, 4)):
            off = [rng.randint(0, g) for g in shape]
            boxes.append((off, [rng.randint(0, g - o + 1) for o, g in zip(off, shape, strict=True)]))
        ext = [max(o[d] + n[d] for o, n in boxes) for d in range(nd)]
        if tiles_simply(boxes, ext):
            seen += 1
            assert _valid(ext, boxes), (ext, boxes)
    assert seen > 20  # the random layouts do reach the fast path
