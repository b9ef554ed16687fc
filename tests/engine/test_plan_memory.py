"""The plan's memory is flat arrays, not objects per tensor; headers are taken one at a time; moves are
streamed in destination order and tile every file's data section exactly once. Structural checks only:
RSS and timing targets live in bench/bench_consolidate.py and BENCHMARKS.md."""

from __future__ import annotations

import gc
import json
import tracemalloc
import weakref
from collections.abc import Iterator

import pytest

from stagerd.contract.safetensors_format import (
    Header,
    encode_header,
    parse_header_bytes,
    validate_header,
)
from stagerd.engine.consolidate import plan
from stagerd.engine.file_header import encode_entries, file_header
from stagerd.engine.index_json import index_json
from stagerd.engine.moves import plan_moves
from stagerd.engine.plan_types import Chunk, ExportPlan, Move, Piece, TensorPlan
from stagerd.errors import PlanError

N_TENSORS = 20_000
RANKS = 2


def synthetic_header_bytes(rank: int, n: int) -> bytes:
    """The header of rank `rank`'s DCP shard of `n` F32 tensors of 16 elements each: three in four split
    on dim 0 ([2, 8] blocks), every fourth on dim 1 ([4, 4] blocks), like a row-parallel projection."""
    entries: dict[str, tuple[str, tuple[int, ...], int, int]] = {}
    info = {}
    for i in range(n):
        name = f"model.layers.{i // 256}.mlp.experts.{i % 256}.weight"
        on_dim1 = i % 4 == 3
        entries[name] = ("F32", (4, 4) if on_dim1 else (2, 8), i * 64, (i + 1) * 64)
        info[name] = {"saved_offsets": [0, 4 * rank] if on_dim1 else [2 * rank, 0]}
    return encode_header(entries, {"DCP_SHARDING_INFO": json.dumps(info), "format": "pt"})


def synthetic_header(rank: int, n: int, ranks: int = RANKS) -> Header:
    """`synthetic_header_bytes`, parsed and validated as the planner takes it."""
    blob = synthetic_header_bytes(rank, n)
    size = len(blob) + n * 64
    hn, obj = parse_header_bytes(f"/shards/shard-{rank + 1:05d}.safetensors", blob, size)
    return validate_header(f"/shards/shard-{rank + 1:05d}.safetensors", hn, obj, size)


def synthetic_headers(n: int) -> Iterator[Header]:
    return (synthetic_header(r, n) for r in range(RANKS))


def reachable(root: object) -> list[object]:
    seen: dict[int, object] = {}
    todo = [root]
    while todo:
        o = todo.pop()
        if id(o) in seen or isinstance(o, type):
            continue
        seen[id(o)] = o
        todo.extend(gc.get_referents(o))
    return list(seen.values())


@pytest.fixture(scope="module")
def big_plan() -> ExportPlan:
    return plan(synthetic_headers(N_TENSORS), max_shard_size=1 << 20)


def test_the_plan_holds_no_object_per_tensor(big_plan):
    objs = reachable(big_plan)
    assert not {type(o) for o in objs} & {Chunk, TensorPlan, Piece, Move}
    assert not [o for o in objs if isinstance(o, str) and o.startswith("model.layers.")]
    # a few containers per output file, and nothing that grows with the tensor count
    assert len(objs) < 50 * len(big_plan.files) + 100, sorted({type(o).__name__ for o in objs})
    assert big_plan.chunks.names[N_TENSORS - 1] == "model.layers.78.mlp.experts.31.weight"
    assert len(set(big_plan.weight_map())) == N_TENSORS


def test_the_plan_costs_at_most_a_few_hundred_bytes_per_tensor():
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        p = plan(synthetic_headers(N_TENSORS))
        gc.collect()
        kept, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    per_tensor = (kept - before) / p.tensor_count
    # Measured 270 B per tensor (2 blocks each); with a dataclass per block and per move it was 1,367 B.
    assert per_tensor < 400, per_tensor
    # The peak is dominated by one shard's decoded header at a time (about 1 kB per entry).
    assert peak - before < 60 << 20, peak - before


def test_headers_are_taken_one_at_a_time():
    alive: list[weakref.ref[Header]] = []
    held: list[int] = []

    def headers() -> Iterator[Header]:
        for r in range(4):
            gc.collect()
            held.append(sum(ref() is not None for ref in alive))
            h = synthetic_header(r, 50, ranks=4)
            alive.append(weakref.ref(h))
            yield h
            del h

    p = plan(headers())
    assert p.tensor_count == 50
    assert held == [0, 0, 0, 0]


def test_moves_stream_in_destination_order_and_tile_each_file(big_plan):
    moves = plan_moves(big_plan)
    assert iter(moves) is moves  # a generator, not a list held beside the plan
    covered = [f.header_size for f in big_plan.files]
    last = (-1, -1)
    for m in moves:
        assert (m.file, m.dst_offset) > last
        assert m.dst_offset == covered[m.file], "a gap or an overlap"
        covered[m.file] += m.length
        last = (m.file, m.dst_offset)
    assert covered == [f.size for f in big_plan.files]


@pytest.mark.parametrize(
    "names",
    [
        ["plain.weight", 'quote"and\\backslash', "ünïcødé.ß", "line\nbreak\u2028", "\x00nul", "tab\t"],
        [],
    ],
)
def test_file_headers_equal_the_contract_encoder(names):
    entries = [
        (n, ("F32", "BF16", "I8")[i % 3], (i, 2) if i % 2 else (), i * 8, i * 8 + 8)
        for i, n in enumerate(names)
    ]
    want = encode_header({n: (d, s, b, e) for n, d, s, b, e in entries}, {"format": "pt"})
    assert encode_entries(entries) == want


def test_plan_headers_equal_the_contract_encoder(big_plan):
    for fi in range(len(big_plan.files)):
        want = encode_header({n: (d, s, b, e) for n, d, s, b, e in big_plan.entries(fi)}, {"format": "pt"})
        got = file_header(big_plan, fi)
        assert got == want and len(got) == big_plan.files[fi].header_size


def test_an_extent_beyond_64_bits_is_a_plan_error():
    h = synthetic_header(0, 1, ranks=1)
    name = next(iter(h.tensors))
    e = h.tensors[name]
    info = {name: {"saved_offsets": [2**63, 0]}}
    blob = encode_header(
        {name: (e.dtype, (0, 8), 0, 0)}, {"DCP_SHARDING_INFO": json.dumps(info), "format": "pt"}
    )
    hn, obj = parse_header_bytes("x.safetensors", blob, len(blob))
    with pytest.raises(PlanError, match="64 bits"):
        plan([validate_header("x.safetensors", hn, obj, len(blob))])


def one_rank_header(names: list[str]) -> Header:
    entries = {n: ("F32", (2,), 8 * i, 8 * i + 8) for i, n in enumerate(names)}
    info = {n: {"saved_offsets": [0]} for n in names}
    blob = encode_header(entries, {"DCP_SHARDING_INFO": json.dumps(info), "format": "pt"})
    size = len(blob) + 8 * len(names)
    hn, obj = parse_header_bytes("/s/shard-00001.safetensors", blob, size)
    return validate_header("/s/shard-00001.safetensors", hn, obj, size)


@pytest.mark.parametrize("max_shard_size", [1 << 30, 20])
def test_the_index_equals_json_of_the_plans_weight_map(max_shard_size):
    names = ["layers.10.w", "layers.2.w", "ünï.1", 'q"uote', "layers.02.w", "\u00e9", "\x01x", "a.007"]
    pinned = {n: "BF16" for n in names[::2]}  # mixed widths reorder each file's rows
    p = plan([one_rank_header(names)], max_shard_size=max_shard_size, out_dtypes=pinned)
    assert index_json(p) == (json.dumps(p.index(), indent=2) + "\n").encode()
    assert list(json.loads(index_json(p))["weight_map"]) == list(p.weight_map())
    empty = plan([])
    assert index_json(empty) == (json.dumps(empty.index(), indent=2) + "\n").encode()


@pytest.mark.parametrize(
    "names", [["layers.10.w", "ünï.1", "layers.2.w", "\u00e9", "a.007", "b"], ["plain", 'q"uote', "\x01x"]]
)
@pytest.mark.parametrize("max_shard_size", [1 << 30, 20])
def test_each_header_size_is_the_length_of_its_header(names, max_shard_size):
    """The plan counts its headers' bytes from the arrays (`rows_header_size`; a name JSON escapes is
    counted by encoding it): every count must be the length of the header `execute` writes."""
    pinned = {n: "BF16" for n in names[::2]}
    p = plan([one_rank_header(names)], max_shard_size=max_shard_size, out_dtypes=pinned)
    assert [f.header_size for f in p.files] == [len(file_header(p, fi)) for fi in range(len(p.files))]
