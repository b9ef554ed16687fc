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

import copy
import dataclasses
import itertools
import json
import math
import random
import re
import signal
import struct
import tracemalloc
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stagerd.contract import dtypes
from stagerd.contract.safetensors_format import (
    MAX_HEADER_BYTES,
    MAX_NDIM,
    METADATA_KEY,
    Header,
    encode_header,
    parse_dcp_sharding_info,
    parse_header_bytes,
    read_header,
    validate_header,
)
from stagerd.errors import DTypeError, HeaderError, ShardError, StagerdError

ALLOWED = (HeaderError, DTypeError, ShardError)
PER_INPUT_SECONDS = 2.0
SHARDING = "DCP_SHARDING_INFO"


class Hang(Exception):
    """An input that ran past the per-input time bound."""


@contextmanager
def time_limit(seconds: float = PER_INPUT_SECONDS) -> Iterator[None]:
    """Raise `Hang` in the running code if it is still running after `seconds` (main thread only)."""

    def on_alarm(signum: int, frame: object) -> None:
        raise Hang(f"input still running after {seconds}s")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


# ---------------------------------------------------------------------------------------------- oracle


@dataclass(frozen=True)
class Outcome:
    """How far an input got: `stage` (bytes, entries, sharding, plan, accepted) and a normalized message."""

    stage: str
    kind: str


# Single character-class repeats only: a repeated group would make `re` allocate per character.
_NOISE = re.compile(r"'[^']*'|\"[^\"]*\"|\[[^\]]*\]|\{[^}]*\}|\d+")


def error_kind(e: StagerdError) -> str:
    """The message template of an error: names, numbers and lists blanked, so kinds can be counted."""
    return f"{e.name}: {_NOISE.sub('_', e.message)[:120]}"


def check_accepted(h: Header, n: int, size: int) -> None:
    """What the parser accepted must agree with the file: anything else is a parser bug."""
    assert h.data_start == 8 + n <= size
    data_len = size - h.data_start
    live = []
    for t in h.tensors.values():
        assert len(t.shape) <= MAX_NDIM
        assert 0 <= t.begin <= t.end <= data_len, t
        assert t.end - t.begin == dtypes.lookup(t.dtype).nbytes(math.prod(t.shape)), t
        if t.end > t.begin:
            live.append(t)
    live.sort(key=lambda t: t.begin)
    for a, b in itertools.pairwise(live):
        assert a.end <= b.begin, (a, b)
    # Accepted means it can be written back: the export writes these names into its own headers.
    entries = {t.name: (t.dtype, t.shape, t.begin, t.end) for t in h.tensors.values()}
    again = encode_header(entries, h.metadata)
    n2, obj2 = parse_header_bytes("re-encoded", again, len(again) + data_len)
    h2 = validate_header("re-encoded", n2, obj2, len(again) + data_len)
    assert {k: (t.dtype, t.shape, t.nbytes) for k, t in h2.tensors.items()} == {
        k: (t.dtype, t.shape, t.nbytes) for k, t in h.tensors.items()
    }


class Meter:
    """Peak traced allocation of the library calls alone, the oracle's own checks excluded."""

    def __init__(self) -> None:
        self.peak = 0

    @contextmanager
    def lib(self) -> Iterator[None]:
        if not tracemalloc.is_tracing():
            yield
            return
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        try:
            yield
        finally:
            self.peak = max(self.peak, tracemalloc.get_traced_memory()[1] - base)


def parse_blob(
    blob: bytes, *, plan: bool = True, companions: Sequence[Header] = (), meter: Meter | None = None
) -> Outcome:
    """Run one in-memory input through the parser (and, if accepted, the planner with the other shards of
    its checkpoint, `companions`); return how far it got.

    A named error is an outcome; any other exception, a `Hang`, or a failed consistency check propagates.
    """
    from stagerd.engine import consolidate

    lib = (meter or Meter()).lib
    with time_limit():
        try:
            with lib():
                n, obj = parse_header_bytes("fuzz.safetensors", blob, len(blob))
        except ALLOWED as e:
            return Outcome("bytes", error_kind(e))
        try:
            with lib():
                h = validate_header("fuzz.safetensors", n, obj, len(blob))
        except ALLOWED as e:
            return Outcome("entries", error_kind(e))
        check_accepted(h, n, len(blob))
        try:
            with lib():
                offsets = parse_dcp_sharding_info(h)
        except ALLOWED as e:
            return Outcome("sharding", error_kind(e))
        assert set(offsets) == set(h.tensors)
        for name, offs in offsets.items():
            assert len(offs) == len(h.tensors[name].shape) and all(o >= 0 for o in offs)
        if not plan:
            return Outcome("accepted", "")
        try:
            with lib():
                p = consolidate.plan([*companions, h])
                p.index()
        except StagerdError as e:
            return Outcome("plan", error_kind(e))
        return Outcome("accepted", "")


def parse_file(path: Path, meter: Meter | None = None) -> Outcome:
    """`read_header` on a file, with the same oracle as `parse_blob` (no planning)."""
    lib = (meter or Meter()).lib
    with time_limit():
        try:
            with lib():
                h = read_header(path)
        except ALLOWED as e:
            return Outcome("file", error_kind(e))
        size = path.stat().st_size
        check_accepted(h, h.data_start - 8, size)
        try:
            parse_dcp_sharding_info(h)
        except ALLOWED as e:
            return Outcome("sharding", error_kind(e))
        return Outcome("accepted", "")


# ---------------------------------------------------------------------------------------------- seeds


@dataclass(frozen=True)
class Seed:
    """A real shard's header, split: the decoded JSON object and the data section bytes."""

    name: str
    obj: dict[str, Any] = dataclasses.field(repr=False)
    data: bytes = dataclasses.field(repr=False)
    # the other shards of the same checkpoint, for planning
    companions: tuple[Header, ...] = dataclasses.field(default=(), repr=False)

    @classmethod
    def from_file(cls, path: Path) -> Seed:
        return cls.from_bytes(path.read_bytes(), path.name)

    @classmethod
    def from_bytes(cls, raw: bytes, name: str = "input") -> Seed:
        """Split a safetensors file; ValueError (or struct.error) if it has no JSON object header."""
        (n,) = struct.unpack("<Q", raw[:8])
        obj = json.loads(raw[8 : 8 + n])
        if not isinstance(obj, dict):
            raise ValueError("header is not a JSON object")
        return cls(name, obj, raw[8 + n :])

    def blob(self) -> bytes:
        body = json.dumps(self.obj).encode()
        return struct.pack("<Q", len(body)) + body + self.data


def load_seeds(model_dir: Path) -> list[Seed]:
    """Every shard of a real DCP save, each with the validated headers of the others."""
    paths = sorted(model_dir.glob("*.safetensors"))
    headers = [read_header(p) for p in paths]
    return [
        dataclasses.replace(Seed.from_file(p), companions=tuple(headers[:i] + headers[i + 1 :]))
        for i, p in enumerate(paths)
    ]


# ---------------------------------------------------------------------------------------------- mutation

HUGE = [2**31 - 1, 2**31, 2**32, 2**53 + 1, 2**62, 2**63 - 1, 2**63, 2**64 - 1, 2**64, 10**30]
INTS = [0, 1, -1, 2, 7, 8, -(2**63), MAX_HEADER_BYTES, MAX_HEADER_BYTES + 1, *HUGE]
VALUES: list[Any] = [
    None,
    True,
    False,
    0.0,
    1.5,
    -0.0,
    1e308,
    "",
    "0",
    "F32",
    [],
    {},
    [[1]],
    [None],
    {"a": 1},
]
NAMES = [
    "../../x",
    "a/b",
    "/etc/passwd",
    "a\\b",
    "\x00",
    "nul\x00inside",
    "\x1b[31mred",
    "line\nbreak",
    "\t",
    " ",
    ".",
    "..",
    METADATA_KEY,
    "é漢字🙂",
    "\ud800",  # a lone surrogate: valid JSON escape, not encodable as UTF-8
    "layer." + "1" * 5000,  # more digits than int() converts by default
    "layers.01",
    "x" * 70_000,
]
DTYPE_NAMES = [*dtypes.DTYPES, "F12", "f32", "", "BF16 ", "U128", "F8"]


def _tensor_names(obj: dict[str, Any]) -> list[str]:
    return [k for k in obj if k != METADATA_KEY]


def _sharding(obj: dict[str, Any]) -> dict[str, Any] | None:
    meta = obj.get(METADATA_KEY)
    if not isinstance(meta, dict) or not isinstance(meta.get(SHARDING), str):
        return None
    try:
        info = json.loads(meta[SHARDING])
    except (ValueError, RecursionError):
        return None
    return info if isinstance(info, dict) else None


def _set_sharding(obj: dict[str, Any], info: Any) -> None:
    meta = obj.get(METADATA_KEY)
    if isinstance(meta, dict):
        meta[SHARDING] = json.dumps(info)


def _value(r: random.Random) -> Any:
    """A fresh copy of one of VALUES: the mutants must never share (and so grow) the module's lists."""
    return copy.deepcopy(r.choice(VALUES))


def _any_value(r: random.Random) -> Any:
    return r.choice([r.choice(INTS), _value(r), r.choice(NAMES)[:50]])


def _mutate_entry(r: random.Random, obj: dict[str, Any]) -> None:
    names = _tensor_names(obj)
    if not names:
        obj[r.choice(NAMES)] = {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}
        return
    name = r.choice(names)
    e = obj[name]
    if not isinstance(e, dict):
        obj[name] = {"dtype": r.choice(DTYPE_NAMES), "shape": [], "data_offsets": [0, 0]}
        return
    field = r.choice(["dtype", "shape", "data_offsets", "drop", "extra", "whole", "copy"])
    if field == "dtype":
        e["dtype"] = r.choice(DTYPE_NAMES) if r.random() < 0.8 else _any_value(r)
    elif field == "shape":
        shape = list(e.get("shape") or []) if isinstance(e.get("shape"), list) else []
        how = r.randrange(6)
        if how == 0:
            shape.append(r.choice([0, 1, 2, *HUGE]))
        elif how == 1 and shape:
            shape.pop(r.randrange(len(shape)))
        elif how == 2 and shape:
            shape[r.randrange(len(shape))] = r.choice(INTS)
        elif how == 3:
            shape = [r.choice([0, 1, *HUGE])] * r.choice([1, 2, MAX_NDIM, MAX_NDIM + 1, 1000])
        elif how == 4 and shape:
            shape[r.randrange(len(shape))] = _value(r)
        else:
            shape = [*shape, 0] if r.random() < 0.5 else [0, *HUGE[:2]]  # zero elements, huge dims
        e["shape"] = shape
    elif field == "data_offsets":
        offs = e.get("data_offsets")
        offs = list(offs) if isinstance(offs, list) and len(offs) == 2 else [0, 0]
        how = r.randrange(6)
        if how == 0:
            offs[r.randrange(2)] = r.choice(INTS)
        elif how == 1:
            offs.reverse()
        elif how == 2:
            k = r.choice([1, 2, 4, 8, -1, -4, 10**6])
            offs = [o + k if isinstance(o, int) else o for o in offs]
        elif how == 3:
            offs = offs[: r.choice([0, 1])] + ([r.choice(INTS)] * r.choice([0, 2]))
        elif how == 4:
            other = obj[r.choice(names)]
            if isinstance(other, dict) and isinstance(other.get("data_offsets"), list):
                offs = list(other["data_offsets"])  # overlap another tensor
        else:
            offs[r.randrange(2)] = _value(r)
        e["data_offsets"] = offs
    elif field == "drop":
        e.pop(r.choice(["dtype", "shape", "data_offsets"]), None)
    elif field == "extra":
        e[r.choice(["dtype2", "offsets", "", "__proto__"])] = _any_value(r)
    elif field == "whole":
        obj[name] = _any_value(r)
    else:  # the same data under another name, with or without a sharding entry
        new = r.choice(NAMES)
        obj[new] = dict(e)
        info = _sharding(obj)
        if info is not None and name in info and r.random() < 0.7:
            info[new] = info[name]
            _set_sharding(obj, info)


def _mutate_names(r: random.Random, obj: dict[str, Any]) -> None:
    """Rename a tensor consistently (header and sharding info), or only in one of them."""
    names = _tensor_names(obj)
    if not names:
        return
    old, new = r.choice(names), r.choice(NAMES)
    if new == old or (new == METADATA_KEY and r.random() < 0.7):
        new = new + "." + r.choice(NAMES)
    obj[new] = obj.pop(old)
    info = _sharding(obj)
    if info is not None and old in info and r.random() < 0.85:
        info[new] = info.pop(old)
        _set_sharding(obj, info)


def _mutate_sharding(r: random.Random, obj: dict[str, Any]) -> None:
    meta = obj.get(METADATA_KEY)
    info = _sharding(obj)
    how = r.randrange(9)
    if how == 0 or info is None:
        if isinstance(meta, dict):
            meta[SHARDING] = r.choice(["{", "[]", "null", "1", '"x"', "[" * 50_000 + "]" * 50_000, ""])
        return
    names = list(info)
    if how == 1 and names:
        info.pop(r.choice(names))
    elif how == 2:
        info[r.choice(NAMES)] = {"saved_offsets": [0]}
    elif how in (3, 4, 5) and names:
        entry = info[r.choice(names)]
        if isinstance(entry, dict) and isinstance(entry.get("saved_offsets"), list):
            offs = entry["saved_offsets"]
            if how == 3 and offs:
                offs[r.randrange(len(offs))] = r.choice(INTS)
            elif how == 4:
                offs.append(r.choice([0, *HUGE]))
            elif offs:
                offs[r.randrange(len(offs))] = _value(r)
    elif how == 6 and names:
        info[r.choice(names)] = _any_value(r)
    elif how == 7 and isinstance(meta, dict):
        meta[r.choice([SHARDING, "format", "x"])] = _any_value(r)
    elif how == 8:
        obj[METADATA_KEY] = _any_value(r)
        return
    _set_sharding(obj, info)


def _encode(r: random.Random, obj: dict[str, Any]) -> bytes:
    how = r.randrange(6)
    if how == 0:
        return json.dumps(obj, ensure_ascii=False).encode("utf-8", "surrogatepass")
    if how == 1:
        return json.dumps(obj, indent=r.choice([0, 2])).encode()
    if how == 2 and _tensor_names(obj):  # a duplicate key: json.loads keeps the last one
        text = json.dumps(obj)
        name = r.choice(_tensor_names(obj))
        dup = json.dumps({name: {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}})[1:-1]
        return (text[:-1] + ", " + dup + "}").encode()
    return json.dumps(obj).encode()


def _mutate_bytes(r: random.Random, body: bytes, data: bytes) -> bytes:
    """Byte-level damage to the framing: the length prefix, the JSON text, the data section."""
    n = len(body)
    how = r.randrange(9)
    if how == 0:
        n = r.choice([n - 1, n + 1, n - 8, n + 8, 0, 1, 7, *HUGE[:6], MAX_HEADER_BYTES + 1, 2**64 - 1])
        n = max(0, min(n, 2**64 - 1))
    elif how == 1 and body:
        i = r.randrange(len(body))
        body = body[:i] + bytes([r.randrange(256)]) + body[i + 1 :]
    elif how == 2 and body:
        i = r.randrange(len(body))
        body = body[:i] + body[i + r.randrange(1, 16) :]
        n = len(body)
    elif how == 3:
        data = data[: max(0, len(data) - r.choice([1, 2, 8, 64, len(data)]))]
    elif how == 4:
        data = data + bytes(r.choice([1, 8, 4096]))
    elif how == 5:
        body = body + b" " * r.choice([1, 7, 8])  # padding, as safetensors writes it
        n = len(body)
    elif how == 6 and body:
        i = r.randrange(len(body))
        body = body[:i] + r.choice([b"\xff", b"\xc3", b"\x00", b"\\", b'"', b"\\ud800"]) + body[i:]
        n = len(body)
    return struct.pack("<Q", n) + body + data


def mutate(seed: Seed, r: random.Random) -> bytes:
    """One structure-aware mutant of a real shard header: 1-3 edits of the JSON tree, then maybe bytes."""
    obj = json.loads(json.dumps(seed.obj))
    for _ in range(r.choice([1, 1, 2, 3])):
        op = r.choices([_mutate_entry, _mutate_names, _mutate_sharding], weights=[5, 2, 3])[0]
        op(r, obj)
    body = _encode(r, obj)
    if r.random() < 0.3:
        return _mutate_bytes(r, body, seed.data)
    return struct.pack("<Q", len(body)) + body + seed.data


def random_bytes(r: random.Random) -> bytes:
    """Unstructured input: random bytes, sometimes behind a length prefix that fits them."""
    body = r.randbytes(r.choice([0, 1, 7, 8, 9, 16, 64, 300]))
    if r.random() < 0.5:
        return struct.pack("<Q", max(0, len(body) - r.randrange(0, 4))) + body
    return body


def random_json(r: random.Random, depth: int = 0) -> Any:
    """A random JSON value with header-ish keys: grammar-aware but unaware of safetensors' rules."""
    kind = r.randrange(7 if depth < 4 else 4)
    if kind == 0:
        return r.choice(INTS)
    if kind == 1:
        return _value(r)
    if kind == 2:
        return r.choice([*DTYPE_NAMES, *NAMES[:6]])
    if kind == 3:
        return r.random()
    if kind == 4:
        return [random_json(r, depth + 1) for _ in range(r.randrange(4))]
    keys = ["dtype", "shape", "data_offsets", METADATA_KEY, SHARDING, "saved_offsets", "w", "b"]
    return {r.choice(keys): random_json(r, depth + 1) for _ in range(r.randrange(5))}


def random_json_blob(r: random.Random) -> bytes:
    body = json.dumps(random_json(r)).encode()
    return struct.pack("<Q", len(body)) + body + r.randbytes(r.choice([0, 4, 64]))


Generator = Callable[[random.Random], tuple[bytes, Sequence[Header]]]


def sweep(gen: Generator, count: int, seed: int) -> Counter:
    """Run `count` inputs from `gen` (blob, companions); return how many ended at each outcome."""
    r = random.Random(seed)
    out: Counter = Counter()
    for _ in range(count):
        blob, companions = gen(r)
        out[parse_blob(blob, companions=companions)] += 1
    return out


def mutants_of(seeds: Sequence[Seed]) -> Generator:
    def gen(r: random.Random) -> tuple[bytes, Sequence[Header]]:
        s = r.choice(seeds)
        return mutate(s, r), s.companions

    return gen


def alone(fn: Callable[[random.Random], bytes]) -> Generator:
    return lambda r: (fn(r), ())


# ---------------------------------------------------------------------------------------------- tests


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
