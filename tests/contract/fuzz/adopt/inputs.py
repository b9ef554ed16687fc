"""Fuzz inputs for what stagerd reads when it adopts a checkpoint (`seeds.py`): byte damage (bit flips,
truncation, spans overwritten with huge numbers), zip-aware damage of `torch.save` archives (Lightning's
meta.pt, a `.distcp` record: their directory's counts, sizes, offsets and zip64 records), records rebuilt
around a generated `data.pkl` of torch's own opcodes with wrong values, and DCP `.metadata` with its
records' fields replaced by wrong types, huge numbers, deep nesting and objects no allowlist takes. The
JSON beside them: `json_inputs.py`."""

from __future__ import annotations

import io
import pickle
import random
import struct
import zipfile
from collections.abc import Callable
from typing import Any

HUGE = [2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**53 + 1, 2**62, 2**63 - 1, 2**63, 2**64 - 1, 2**64, 10**30]
INTS = [0, 1, -1, 2, 3, 7, 8, 16, -(2**63), *HUGE]
STRS = ["", "x", "../x", "/etc/passwd", "a/b", "\x00", "nul\x00in", "\ud800", "line\nbreak", "\x1b[2J"]
STRS += ["é漢🙂"]
SCALARS: list[Any] = [None, True, False, 0.0, -0.0, 1.5, 1e308, float("inf"), float("nan"), *STRS[:4]]


def damage(r: random.Random, blob: bytes) -> bytes:
    """Byte-level damage anywhere: flip bits, cut, insert, delete, duplicate, or write a huge number."""
    b = bytearray(blob)
    how = r.randrange(7)
    if not b or how == 0:
        return bytes(b[: r.randrange(len(b) + 1)])  # truncated
    i = r.randrange(len(b))
    if how == 1:
        for _ in range(r.choice([1, 1, 2, 8])):
            j = r.randrange(len(b))
            b[j] ^= 1 << r.randrange(8)
    elif how == 2:
        b[i:i] = r.choice([b"\x00", b"\xff", b"PK\x03\x04", b"PK\x05\x06", r.randbytes(r.choice([1, 4, 30]))])
    elif how == 3:
        del b[i : i + r.choice([1, 2, 4, 16, 64])]
    elif how == 4:
        w = r.choice([2, 4, 8])
        b[i : i + w] = r.choice([0, 1, 2**w * 8 - 1, 2 ** (w * 8 - 1), r.randrange(2 ** (w * 8))]).to_bytes(
            w, "little"
        )
    elif how == 5:
        j = r.randrange(len(b))
        b[i:i] = b[j : j + r.choice([8, 30, 64, 512])]
    else:
        b[i] = r.randrange(256)
    return bytes(b)


# ---------------------------------------------------------------------------------------------- zip

# (signature, {field offset: width}) of the zip records whose numbers a reader trusts
_ZIP_FIELDS = {
    b"PK\x05\x06": {8: 2, 10: 2, 12: 4, 16: 4, 20: 2},  # end of central directory
    b"PK\x01\x02": {6: 2, 8: 2, 10: 2, 20: 4, 24: 4, 28: 2, 30: 2, 32: 2, 34: 2, 42: 4},  # central directory
    b"PK\x03\x04": {6: 2, 8: 2, 18: 4, 22: 4, 26: 2, 28: 2},  # local header
    b"PK\x06\x06": {24: 8, 32: 8, 40: 8, 48: 8},  # zip64 end of central directory
    b"PK\x06\x07": {4: 4, 8: 8, 16: 4},  # zip64 locator
}


def _zip64_tail(r: random.Random, blob: bytes) -> bytes:
    """A zip64 end record and locator before the end record, with numbers of its own (zipfile follows
    them: where the directory is, how big it is, how many entries)."""
    eocd = blob.rfind(b"PK\x05\x06")
    if eocd < 0:
        return blob
    n = lambda: r.choice([0, 1, 7, eocd, len(blob), *HUGE[4:9]])  # noqa: E731
    rec = b"PK\x06\x06" + struct.pack("<QHHIIQQQQ", 44, 45, 45, 0, 0, n(), n(), n(), n())
    loc = b"PK\x06\x07" + struct.pack("<IQI", 0, r.choice([eocd, 0, len(blob) + 8, 2**63, 2**64 - 1]), 1)
    end = bytearray(blob[eocd:])
    if r.random() < 0.7:  # the classic record's numbers saturated: the zip64 ones are read
        end[8:20] = b"\xff\xff\xff\xff" + b"\xff" * 8
    return blob[:eocd] + rec + loc + bytes(end)


def zip_damage(r: random.Random, blob: bytes) -> bytes:
    """A number in one of the zip's own records replaced (a count, a size, an offset, a name's length),
    a zip64 tail added, or plain byte damage."""
    how = r.randrange(4)
    if how == 0:
        return _zip64_tail(r, blob)
    if how == 1:
        return damage(r, blob)
    places = [(at, sig) for sig in _ZIP_FIELDS for at in _find_all(blob, sig)]
    if not places:
        return damage(r, blob)
    b = bytearray(blob)
    for _ in range(r.choice([1, 1, 2, 3])):
        at, sig = r.choice(places)
        off, w = r.choice(list(_ZIP_FIELDS[sig].items()))
        v = r.choice([0, 1, 2, 8, 99, 2 ** (8 * w) - 1, 2 ** (8 * w - 1), r.randrange(2 ** (8 * w))])
        b[at + off : at + off + w] = v.to_bytes(w, "little")[: len(b[at + off : at + off + w])]
    return bytes(b)


def _find_all(blob: bytes, sig: bytes) -> list[int]:
    out, i = [], blob.find(sig)
    while i >= 0 and len(out) < 64:
        out.append(i)
        i = blob.find(sig, i + 1)
    return out


# ---------------------------------------------------------------------------------------------- records


class G:
    """A global a pickle names (`module.name`), written as one GLOBAL opcode: no such object is needed."""

    def __init__(self, module: str, name: str) -> None:
        self.module, self.name = module, name


class R:
    """`func(*args)`: REDUCE."""

    def __init__(self, func: Any, args: tuple[Any, ...]) -> None:
        self.func, self.args = func, args


class P:
    """A persistent id: BINPERSID."""

    def __init__(self, pid: Any) -> None:
        self.pid = pid


def emit(v: Any) -> bytes:
    """Opcodes that build `v` (no PROTO, no STOP): what torch's pickler writes for a record's values."""
    if isinstance(v, G):
        return b"c" + v.module.encode() + b"\n" + v.name.encode() + b"\n"
    if isinstance(v, R):
        return emit(v.func) + emit(v.args) + b"R"
    if isinstance(v, P):
        return emit(v.pid) + b"Q"
    if isinstance(v, tuple):
        return b"(" + b"".join(emit(x) for x in v) + b"t"
    if isinstance(v, list):
        return b"(" + b"".join(emit(x) for x in v) + b"l"
    if isinstance(v, dict):
        return b"(" + b"".join(emit(k) + emit(x) for k, x in v.items()) + b"d"
    if isinstance(v, str):
        raw = v.encode("utf-8", "surrogatepass")
        return b"X" + struct.pack("<I", len(raw)) + raw
    if isinstance(v, bool | int) and not isinstance(v, bool):
        return b"L" + str(v).encode() + b"L\n"
    return pickle.dumps(v, 2)[2:-1]  # None, bools, floats


_STORAGES = ["FloatStorage", "BFloat16Storage", "HalfStorage", "ByteStorage", "Float8_e4m3fnStorage"]
_STORAGES += ["LongStorage", "QInt8Storage", "UntypedStorage", "Nope"]
_DTYPES = ["float32", "bfloat16", "float8_e4m3fn", "int64", "complex128", "qint8", "bool", "Nope"]


def record_pickle(r: random.Random, numel: int) -> bytes:
    """A `data.pkl` as torch writes one (`_rebuild_tensor_v2`/`_v3` of a persistent storage), each value
    right or replaced by a wrong one."""

    def pick(right: Any, *wrong: Any) -> Any:
        return right if r.random() < 0.75 else r.choice([*wrong, r.choice(INTS), r.choice(SCALARS)])

    v3 = r.random() < 0.3
    storage_cls = G("torch.storage", "UntypedStorage") if v3 else G("torch", r.choice(_STORAGES[:5]))
    storage_cls = pick(storage_cls, G("torch", r.choice(_STORAGES)), G("os", "system"), ("x",))
    item = 1 if v3 else 4
    n = pick(numel // item if not v3 else numel, *HUGE[:4], -1, numel + 1)
    pid = pick(("storage", storage_cls, pick("0", "1", "../0", 0), "cpu", n), ("storage",), "storage")
    dims = r.choice([1, 1, 2, 3, 64, 65])
    size = tuple([1] * (dims - 1) + [numel // item if not v3 else numel])
    size = pick(size, (), (r.choice(HUGE),) * r.choice([1, 2]), (-1,), [numel], tuple(range(200)))
    stride = pick(tuple(1 for _ in size) if isinstance(size, tuple) else (1,), (0,), (2,), (1, 1, 1))
    offset = pick(0, 1, -1, *HUGE[:3])
    hooks = R(G("collections", "OrderedDict"), ())
    args: tuple[Any, ...] = (P(pid), offset, size, stride, False, hooks)
    if v3:
        args = (*args, pick(G("torch", "float8_e4m3fn"), *(G("torch", d) for d in _DTYPES)))
    fn = pick(G("torch._utils", "_rebuild_tensor_v3" if v3 else "_rebuild_tensor_v2"),
              G("torch._utils", "_rebuild_parameter"), G("builtins", "eval"))  # fmt: skip
    top: Any = R(fn, args)
    if r.random() < 0.05:
        top = r.choice([{"t": top}, [top], b"x", None])
    body = emit(top)
    if r.random() < 0.1:
        body = b"(" * r.choice([50, 101, 5000]) + body  # left on the stack under marks
    return b"\x80\x02" + body + b"."


def rebuild_record(r: random.Random, seed: bytes) -> bytes:
    """The seed record's archive written again, a member replaced, dropped, renamed or compressed."""
    with zipfile.ZipFile(io.BytesIO(seed)) as z:
        members = {i.filename: z.read(i) for i in z.infolist()}
    pkl = next(n for n in members if n.endswith("/data.pkl"))
    prefix = pkl.removesuffix("data.pkl")
    numel = len(members.get(prefix + "data/0", b""))
    how = r.randrange(5)
    if how <= 1:
        members[pkl] = record_pickle(r, numel)
    elif how == 2:
        members[pkl] = damage(r, members[pkl])
    elif how == 3:
        data = members[prefix + "data/0"]
        members[prefix + "data/0"] = r.choice([b"", data[:-1], data + b"\0", data * 2])
    else:
        name = r.choice(list(members))
        value = members.pop(name)
        if r.random() < 0.6:
            other = ["data.pkl", "a/b/data.pkl", prefix + "data/1", "../" + name, name + "/"]
            members[r.choice(other)] = value
    compress = zipfile.ZIP_DEFLATED if r.random() < 0.1 else zipfile.ZIP_STORED
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", compression=compress) as z:
        for name, value in members.items():
            z.writestr(name, value)
    return out.getvalue()


def record_mutant(r: random.Random, seed: bytes) -> bytes:
    how = r.randrange(4)
    if how <= 1:
        return rebuild_record(r, seed)
    if how == 2:
        return zip_damage(r, seed)
    return damage(r, seed)


# ---------------------------------------------------------------------------------------------- .metadata


class Canary:
    """A value whose unpickling calls `touched`: the oracle checks no reader ever runs it."""

    touched: list[int] = []

    def __reduce__(self) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        return (canary_called, ())


def canary_called() -> None:
    Canary.touched.append(1)


def _slots(obj: Any, depth: int = 0) -> list[tuple[Any, Any]]:
    """Every (holder, key) of a value in the object tree of torch's Metadata: attributes, items."""
    out: list[tuple[Any, Any]] = []
    if depth > 8:
        return out
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.append((obj, k))
            out += _slots(v, depth + 1)
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out.append((obj, i))
            out += _slots(v, depth + 1)
    elif hasattr(obj, "__dict__") and not isinstance(obj, type):
        for k, v in vars(obj).items():
            out.append((obj, ("attr", k)))
            out += _slots(v, depth + 1)
    return out


def _wrong(r: random.Random, old: Any, everything: list[Any]) -> Any:
    import torch

    how = r.randrange(10)
    if how == 0:
        return r.choice(INTS)
    if how == 1:
        return r.choice(SCALARS)
    if how == 2 and isinstance(old, tuple):  # torch.Size: a dim huge, negative, dropped, added
        dims = list(old)
        if dims and r.random() < 0.5:
            dims[r.randrange(len(dims))] = r.choice([-1, *HUGE])
        else:
            dims.append(r.choice([0, 1, 2**40]))
        fits = all(isinstance(d, int) and -(2**63) <= d < 2**63 for d in dims)
        return torch.Size(dims) if fits else tuple(dims)
    if how == 3:
        return r.choice([torch.complex128, torch.quint8, torch.float8_e5m2, torch.sparse_coo, torch.int4])
    if how == 4:
        return r.choice(everything)  # another record where this one was: aliasing, cycles
    if how == 5:
        deep: Any = 1
        for _ in range(r.choice([50, 99, 100, 101, 3000])):
            deep = (deep,)
        return deep
    if how == 6:
        return r.choice([Canary(), __import__("datetime").date(2020, 1, 1), {1, 2}, frozenset({(1,)})])
    if how == 7:
        return [old] * r.choice([2, 1000]) if r.random() < 0.5 else (old, old)
    if how == 8:
        return r.choice(STRS) * r.choice([1, 5000])
    return None


def metadata_mutant(r: random.Random, seed: bytes) -> bytes:
    """torch's own Metadata of the seed, 1-3 of its fields replaced (`_wrong`), pickled again; or damaged."""
    if r.random() < 0.25:
        return damage(r, seed)
    meta = pickle.loads(seed)  # our own seed, from a real dcp.save
    slots = _slots(meta)
    everything = [meta, *(_get(h, k) for h, k in slots)]
    for _ in range(r.choice([1, 1, 2, 3])):
        holder, key = r.choice(slots)
        try:
            new = _wrong(r, _get(holder, key), everything)
        except (KeyError, IndexError, AttributeError):  # an earlier edit took it away
            continue
        if r.random() < 0.15 and isinstance(holder, dict):
            holder.pop(key, None)
            continue
        if isinstance(key, tuple):
            object.__setattr__(holder, key[1], new)
        elif isinstance(holder, dict) and r.random() < 0.1 and isinstance(new, str | int):
            holder[new] = holder.pop(key)  # another key
        else:
            holder[key] = new
    try:
        blob = pickle.dumps(meta, protocol=r.choice([2, 4, 5]))
    except Exception:  # torch's own __getstate__ refuses some values: those are not a file DCP writes
        return damage(r, seed)
    return damage(r, blob) if r.random() < 0.1 else blob


def _get(holder: Any, key: Any) -> Any:
    return getattr(holder, key[1]) if isinstance(key, tuple) else holder[key]
