"""Fuzzing the header parser: `read_header`, `parse_header_bytes`, `validate_header`, DCP sharding info.

Properties, for every input:
- the only exceptions are HeaderError, DTypeError and ShardError;
- no input runs longer than `PER_INPUT_SECONDS` (a SIGALRM timer raises `Hang` inside the parser);
- a claimed length, shape or offset never turns into an allocation of that size (tracemalloc);
- what the parser accepts is consistent with its file (bounds, sizes, no overlap), can be written back by
  `encode_header`, and can be planned by `consolidate.plan` without an unnamed exception.

Inputs come from two kinds of generator: random bytes / random JSON, and structure-aware mutation of the
real DCP shard headers of the `dcp_mixed` fixture. `bench/fuzz_headers.py` runs the same machinery over far
more inputs (and with atheris); this module runs a deterministic slice of it.
"""

from __future__ import annotations

import json
import random
import struct
import tracemalloc
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stagerd.contract.header_entries import MAX_NDIM
from stagerd.contract.safetensors_format import (
    MAX_HEADER_BYTES,
    METADATA_KEY,
)
from tests.contract.fuzz.inputs import alone, mutants_of, mutate, random_bytes, random_json_blob, sweep
from tests.contract.fuzz.oracle import SHARDING, Meter, Outcome, Seed, load_seeds, parse_blob, parse_file


@pytest.fixture(scope="module")
def seeds(dcp_mixed) -> list[Seed]:
    src, _ = dcp_mixed
    found = load_seeds(src)
    assert len(found) == 4
    return found


def test_real_shards_are_accepted_and_planned(seeds):
    for s in seeds:
        assert parse_blob(s.blob(), companions=s.companions) == Outcome("accepted", "")


@settings(
    max_examples=1500,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(st.integers(0, 3), st.randoms(use_true_random=False))
def test_structure_aware_mutants_of_real_dcp_headers(seeds, which, rnd):
    parse_blob(mutate(seeds[which], rnd), companions=seeds[which].companions)


@settings(max_examples=600, derandomize=True, database=None, deadline=None)
@given(st.randoms(use_true_random=False), st.booleans())
def test_random_bytes_and_random_json(rnd, as_json):
    parse_blob(random_json_blob(rnd) if as_json else random_bytes(rnd))


def test_mutation_reaches_deeper_than_random_bytes(seeds):
    """Both generators hold the properties; mutants of real headers get past the framing far more often."""
    n = 1500
    mutants = sweep(mutants_of(seeds), n, seed=7)
    noise = sweep(alone(random_bytes), n, seed=7)
    jsons = sweep(alone(random_json_blob), n, seed=7)

    def deep(c: Counter) -> int:
        return sum(v for o, v in c.items() if o.stage in ("sharding", "plan", "accepted"))

    assert deep(noise) == 0  # random bytes never get a valid header through
    assert deep(mutants) > deep(jsons) and deep(mutants) > n // 10
    assert len(mutants) > 2 * len(noise) and len(mutants) > len(jsons)
    assert {o.stage for o in mutants} >= {"bytes", "entries", "sharding", "plan", "accepted"}


def test_read_header_agrees_with_the_in_memory_parse(seeds, tmp_path):
    r = random.Random(11)
    for i in range(300):
        blob = mutate(r.choice(seeds), r) if i % 3 else random_bytes(r)
        p = tmp_path / "x.safetensors"
        p.write_bytes(blob)
        from_file, in_memory = parse_file(p), parse_blob(blob, plan=False)
        assert (from_file.stage == "accepted") == (in_memory.stage == "accepted"), (from_file, in_memory)


# The planner's `natural_key` and `encode_header` are where accepted names are used; these two inputs are
# what the fuzzer found there. Kept as named cases so they fail with a readable message.


def _one_tensor(name: str) -> bytes:
    info = json.dumps({name: {"saved_offsets": [0]}})
    body = json.dumps(
        {METADATA_KEY: {SHARDING: info}, name: {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}
    )
    return struct.pack("<Q", len(body)) + body.encode() + b"\0" * 4


def test_a_lone_surrogate_name_is_a_header_error():
    """`"\\ud800"` is a valid JSON escape but no UTF-8 string: accepting it crashes `encode_header`."""
    assert parse_blob(_one_tensor("w\ud800")).stage == "entries"


def test_a_name_with_thousands_of_digits_is_planned_or_refused_by_name():
    """`natural_key` calls int() on digit runs, which refuses more than 4300 digits with a ValueError."""
    assert parse_blob(_one_tensor("layer." + "1" * 5000)).stage in ("accepted", "plan")


# ---------------------------------------------------------------------------------------------- memory


def _peak(fn: Callable[[Meter], object]) -> int:
    """Peak traced allocation of the library calls in `fn(meter)`, after one unmeasured call (lazy imports
    are not the input's)."""
    fn(Meter())
    meter = Meter()
    tracemalloc.start()
    try:
        fn(meter)
    finally:
        tracemalloc.stop()
    return meter.peak


def _claims() -> dict[str, bytes]:
    """Small inputs whose lengths, shapes or offsets claim gigabytes to exabytes."""

    def hdr(obj: Any, data: bytes = b"", n: int | None = None) -> bytes:
        body = json.dumps(obj).encode()
        return struct.pack("<Q", len(body) if n is None else n) + body + data

    def t(shape: Any, offs: Any, dtype: str = "F32") -> dict[str, Any]:
        return {"dtype": dtype, "shape": shape, "data_offsets": offs}

    meta = {SHARDING: json.dumps({"w": {"saved_offsets": [2**63] * 2}})}
    return {
        "length 2^64-1": hdr({}, n=2**64 - 1),
        "length at the limit": hdr({}, n=MAX_HEADER_BYTES),
        "length one past the file": hdr({}, n=3),
        "shape 2^62 x 2^62": hdr({"w": t([2**62, 2**62], [0, 4])}, b"\0" * 4),
        "shape with 10^300": hdr({"w": t([10**300], [0, 4])}, b"\0" * 4),
        "64 huge dims": hdr({"w": t([2**63] * MAX_NDIM, [0, 4])}, b"\0" * 4),
        "zero elements, huge dims": hdr({METADATA_KEY: meta, "w": t([2**62, 0], [0, 0])}),
        "offsets to 2^63": hdr({"w": t([2], [0, 2**63])}, b"\0" * 8),
        "offsets 2^64 wide": hdr({"w": t([2**62], [2**64, 2**64 + 2**64])}),
        "saved_offsets 2^63": hdr({METADATA_KEY: meta, "w": t([1, 1], [0, 4])}, b"\0" * 4),
    }


@pytest.mark.parametrize("case", list(_claims()))
def test_claimed_sizes_allocate_nothing_proportional(case, tmp_path):
    blob = _claims()[case]
    bound = 64 * 1024 + 32 * len(blob)  # the JSON tree of the input itself; claims are ~2^60 or more
    assert _peak(lambda m: parse_blob(blob, meter=m)) < bound
    p = tmp_path / "claim.safetensors"
    p.write_bytes(blob)
    assert _peak(lambda m: parse_file(p, meter=m)) < bound


def test_the_meter_sees_an_allocation_a_claim_would_cause():
    """The bound above can fail: a parser that allocated a claimed 16 MiB would be caught."""

    def greedy(meter: Meter) -> None:
        with meter.lib():
            bytearray(16 << 20)

    assert _peak(greedy) >= 16 << 20
