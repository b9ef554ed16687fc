"""The pickle depth scan: the C scan and the Python one give the same verdict on every input, and neither
passes a pickle that CPython's unpickler builds deeper than the limit."""

from __future__ import annotations

import collections
import io
import pathlib
import pickle
import random
import struct

import pytest

from stagerd.contract import pickle_depth as pd
from stagerd.contract.adopt.dcp_metadata import parse_dcp_metadata
from stagerd.contract.pickle_depth import PickleShapeError, check_depth
from stagerd.errors import DcpFormatError

DEEP = b"\x80\x04}" + b")" + b"\x85" * 1_000_000 + b"K\x01s."


try:
    from stagerd.contract._pickle_depth import scan as c_scan
except ImportError:  # built without a C compiler: the Python scan alone
    c_scan = None


def _both(data: bytes, limit: int = pd.MAX_DEPTH) -> tuple[int, int, int]:
    got = pd.scan_py(data, limit)
    if c_scan is not None:
        assert c_scan(data, pd._TABLE, limit) == got, data
    return got


def _nest(n: int, make=lambda x: (x,)) -> object:
    v: object = 0
    for _ in range(n):
        v = make(v)
    return v


class _Rec:
    def __init__(self, **kw):
        self.__dict__.update(kw)


def _objects() -> list[object]:
    shared = [1, 2]
    return [
        None,
        1,
        2**100,
        "x",
        b"y",
        bytearray(b"z"),
        1.5,
        (1, (2, (3,))),
        [1, [2, [3]]],
        {"a": (1, 2), (1, (2,)): {3, 4}},
        frozenset({1, (2, 3)}),
        collections.OrderedDict(a=[1]),
        pathlib.PurePosixPath("/a/b"),
        [shared, shared, (shared,)],
        _Rec(a=(1, (2,)), b=[_Rec(c=3)]),
        _nest(99),
        _nest(100),
        _nest(101),
        _nest(150, lambda x: [x]),
        _nest(120, lambda x: {"k": x}),
        _nest(101, lambda x: _Rec(v=x)),
    ]


def _depth(v: object, seen: frozenset[int] = frozenset()) -> int:
    """How deep `v` nests, as the scan counts it (a leaf 0); objects in a cycle are skipped by the callers."""
    if id(v) in seen:
        raise RecursionError("cycle")
    seen = seen | {id(v)}
    if isinstance(v, dict):
        kids = [*v.keys(), *v.values()]
    elif isinstance(v, (tuple, list, set, frozenset)):
        kids = list(v)
    elif isinstance(v, _Rec):
        kids = list(vars(v).values())
    else:
        return 0
    return 1 + max((_depth(k, seen) for k in kids), default=-1)


def _plain(v: object) -> bool:
    if isinstance(v, dict):
        return all(_plain(k) and _plain(x) for k, x in v.items())
    if isinstance(v, (tuple, list)):
        return all(_plain(x) for x in v)
    return isinstance(v, (int, str)) or v is None


def test_the_c_and_python_scans_agree_and_never_pass_a_deeper_value():
    for proto in range(pickle.HIGHEST_PROTOCOL + 1):
        for obj in _objects():
            data = pickle.dumps(obj, protocol=proto)
            real = _depth(pickle.loads(data))
            if real:
                assert _both(data, real - 1)[0] == pd.TOO_DEEP
            if _plain(obj):  # exact where the pickle builds each container itself, not by a call
                assert _both(data, real)[0] == pd.OK
                assert (_both(data)[0] == pd.OK) == (real <= pd.MAX_DEPTH)


class _Plain(pickle.Unpickler):
    def find_class(self, module, name):
        if (module, name) in {("__main__", "_Rec"), (__name__, "_Rec")}:
            return _Rec
        if module in ("builtins", "collections", "pathlib", "copyreg", "_codecs"):
            return super().find_class(module, name)
        raise pickle.UnpicklingError("refused")


def test_mutated_pickles_get_one_verdict_and_none_that_loads_deeper_passes():
    rng = random.Random(7)
    objects = _objects()[:-6]
    loaded = 0
    for _ in range(3000):
        data = bytearray(pickle.dumps(rng.choice(objects), protocol=rng.randrange(6)))
        for _ in range(rng.randrange(1, 4)):
            at = rng.randrange(len(data) + 1)
            what = rng.randrange(4)
            if what == 0 and at < len(data):
                data[at] = rng.randrange(256)
            elif what == 1:
                data[at:at] = bytes([rng.choice(b"(0124t\x85]aels}u)\x94hgpqr.")])
            elif what == 2:
                del data[at : at + 1]
            else:
                data[at:at] = data[rng.randrange(len(data)) :][: rng.randrange(1, 8)]
        for limit in (0, 1, 2, 5):
            _both(bytes(data), limit)
        if _both(bytes(data), 1000)[0] != pd.OK:  # refused: never loaded (some would take GiBs to load)
            continue
        try:
            real = _depth(_Plain(io.BytesIO(bytes(data))).load())
        except Exception:  # refused, garbled, or a cycle: nothing to compare
            continue
        loaded += 1
        assert _both(bytes(data), max(real - 1, 0))[0] != pd.OK or real == 0, bytes(data)
    assert loaded > 150


@pytest.mark.parametrize(
    ("data", "verdict"),
    [
        (DEEP, pd.TOO_DEEP),
        (b"\x80\x04]" + b"]" * 200 + b"a" * 200 + b".", pd.TOO_DEEP),  # lists appended into each other
        # a list memoized, then grown: as deep wherever the memo gives it
        (b"\x80\x04]q\x00)" + b"\x85" * 60 + b"ah\x00" + b"\x85" * 40 + b".", pd.TOO_DEEP),
        (b"\x80\x04]q\x00)" + b"\x85" * 60 + b"ah\x00" + b"\x85" * 39 + b".", pd.OK),
        (b"\x80\x04]q\x00h\x00a.", pd.GROWS_INSIDE),  # a list holding itself: grown once inside
        (b"\x80\x04]q\x00Nah\x00\x850Na.", pd.OK),  # put inside, then given a leaf: no deeper
        (b"\x80\x04N.", pd.OK),
        (b"\x80\x04N", pd.TRUNCATED),
        (b"\x80\x04\xff.", pd.UNKNOWN_OPCODE),
        (b"\x80\x04.", pd.UNDERFLOW),
        (b"\x80\x04N(a.", pd.UNDERFLOW),  # APPEND may not reach below a MARK
        (b"\x80\x04N(0.", pd.OK),  # POP drops a MARK on top, as the unpickler does
        (b"\x80\x04Nt.", pd.NO_MARK),
        (b"(Np1x\n.", pd.BAD_KEY),
        (b"\x80\x04Nr" + struct.pack("<I", 1 << 26) + b".", pd.KEY_AHEAD),  # 1 GiB of memo to load
        (b"\x80\x04h\x00.", pd.NOT_STORED),
        (b"\x80\x04T\xff\xff\xff\xff.", pd.NEGATIVE),
        (b"\x80\x04\x95\x02\x00\x00\x00\x00\x00\x00\x00N.", pd.OK),  # FRAME only chunks the stream
    ],
)
def test_handmade_pickles(data, verdict):
    assert _both(data)[0] == verdict
    if verdict == pd.OK:
        pickle.loads(data)
    else:
        with pytest.raises(
            PickleShapeError, match="more than 100 deep" if verdict == pd.TOO_DEEP else "malformed"
        ):
            check_depth(data)


def test_without_the_c_scan_the_python_one_gives_the_same_error(monkeypatch):
    with pytest.raises(PickleShapeError) as compiled:
        check_depth(DEEP)
    monkeypatch.setattr(pd, "_pickle_depth", None)
    with pytest.raises(PickleShapeError) as python:
        check_depth(DEEP)
    assert str(compiled.value) == str(python.value) == "nests values more than 100 deep"
    assert compiled.value.too_deep and python.value.too_deep


def test_a_mark_popped_by_pop_cannot_hide_depth():
    """POP drops a MARK on top of the stack; the scan once dropped the value below it instead, and then
    counted each later value from the wrong one: 11,000 rounds of (90 TUPLE1, MARK, POP, a pair) kept every
    depth it saw under 100 while the tuple grew a million deep, and its hash killed the daemon (SIGSEGV)."""
    k = 11_000
    data = b"\x80\x04" + b"N" * k + b")" + (b"\x85" * 90 + b"(0N\x86") * k + b"q\x00(h\x00\x91."
    with pytest.raises(DcpFormatError, match="nests values more than 100 deep"):
        parse_dcp_metadata(data, "step-1/.metadata")
