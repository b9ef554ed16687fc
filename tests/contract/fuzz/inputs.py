"""Fuzz inputs for the header parser: structure-aware mutants of real DCP shard headers, random bytes and
random JSON. `test_fuzz_headers` and `bench/fuzz_headers.py` both draw from them."""

from __future__ import annotations

import copy
import json
import random
import struct
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from stagerd.contract import dtypes
from stagerd.contract.header_entries import MAX_NDIM
from stagerd.contract.safetensors_format import (
    MAX_HEADER_BYTES,
    METADATA_KEY,
    Header,
)
from tests.contract.fuzz.oracle import SHARDING, Seed, parse_blob

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
