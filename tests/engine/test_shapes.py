"""`shapes.global_shapes` reads the chunk table in numpy passes; it must give exactly what the loop per
tensor gives (shapes, and which tensors tile simply), and leave everything unusual to that loop, which
names what is wrong."""

from __future__ import annotations

import itertools
import random
from array import array

import pytest

from stagerd.engine import shapes
from stagerd.engine.chunk_table import freeze_table
from stagerd.engine.plan_types import ChunkTable
from stagerd.engine.shapes import _batched, _per_tensor, global_shapes
from stagerd.errors import PlanError

Box = tuple[list[int], list[int]]


def _table(tensors: list[list[Box]], rnd: random.Random) -> ChunkTable:
    """A table of these blocks per tensor, in a shuffled order (as the ranks' shards interleave them)."""
    blob, name_end, dtype = bytearray(), array("q"), array("B")
    tensor, src, ndim = array("i"), array("i"), array("B")
    offset, at, dims = array("q"), array("q"), array("q")
    blocks = [(t, box) for t, boxes in enumerate(tensors) for box in boxes]
    rnd.shuffle(blocks)
    for t in range(len(tensors)):
        blob += f"t{t}".encode()
        name_end.append(len(blob))
        dtype.append(0)
    for t, (o, n) in blocks:
        tensor.append(t)
        src.append(0)
        offset.append(0)
        at.append(len(dims))
        ndim.append(len(o))
        dims.extend(o)
        dims.extend(n)
    return freeze_table(("/ckpt/shard",), blob, name_end, dtype, tensor, src, offset, at, ndim, dims)


def _boxes(rnd: random.Random) -> list[Box]:
    nd = rnd.choice([0, 1, 2, 3])
    shape = [rnd.choice([1, 2, 3, 4, 6]) for _ in range(nd)]
    kind = rnd.random()
    if kind < 0.3 or nd == 0:
        boxes: list[Box] = [([0] * nd, shape)]
        if nd and rnd.random() < 0.2:
            boxes.append(([0] * nd, shape))  # a replica
    elif kind < 0.8:  # split along one dim, sometimes with a gap, a repeat or an empty piece
        d = rnd.randrange(nd)
        cuts = sorted({0, shape[d], *(rnd.randint(0, shape[d]) for _ in range(rnd.randint(0, 3)))})
        boxes = []
        for a, b in itertools.pairwise(cuts):
            o, n = [0] * nd, list(shape)
            o[d], n[d] = a, b - a
            boxes.append((o, n))
        if rnd.random() < 0.2 and len(boxes) > 1:
            boxes.pop(rnd.randrange(len(boxes)))
        if rnd.random() < 0.2:
            boxes.append(boxes[0])
    else:  # anything
        boxes = [
            ([rnd.randint(0, 3) for _ in range(nd)], [rnd.randint(0, 3) for _ in range(nd)])
            for _ in range(rnd.randint(1, 4))
        ]
    if nd and rnd.random() < 0.05:
        boxes.append(([0] * (nd - 1), shape[:-1]))  # a block of another rank
    return boxes


def _loop(table: ChunkTable, n: int) -> tuple[bytes, ...] | str:
    try:
        return tuple(map(bytes, _per_tensor(table, [f"t{t}" for t in range(n)])))
    except PlanError:
        return "refused"


@pytest.mark.parametrize("seed", range(4))
def test_the_numpy_passes_agree_with_the_loop_per_tensor(seed, monkeypatch):
    monkeypatch.setattr(shapes, "_BATCH", 1 + seed)  # tables of up to 8 tensors, in batches
    rnd = random.Random(seed)
    taken = 0
    for _ in range(1500):
        tensors = [_boxes(rnd) for _ in range(rnd.randint(1, 8))]
        table = _table(tensors, rnd)
        want = _loop(table, len(tensors))
        got = _batched(table, len(tensors))
        if got is None:
            continue
        taken += 1
        assert want != "refused", tensors  # everything the loop refuses is left to it
        assert tuple(map(bytes, got)) == want, tensors
    assert taken > 1000  # most tables take the fast way


def test_what_is_wrong_is_still_named():
    rnd = random.Random(0)
    mixed = _table([[([0, 0], [2, 4]), ([2], [2])]], rnd)
    with pytest.raises(PlanError, match="chunks of different ranks"):
        global_shapes(mixed, ["t0"])
    huge = _table([[([(1 << 62) + (1 << 61)], [1 << 62])]], rnd)
    with pytest.raises(PlanError, match="does not fit 64 bits"):
        global_shapes(huge, ["t0"])
