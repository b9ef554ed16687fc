"""The checks of a safetensors header's entries: each tensor's dtype, shape and data offsets against the
data section, `__metadata__`'s strings, and no two tensors sharing data bytes.

Pure Python; `safetensors_format.py` reads the header and hands each decoded member here.
"""

from __future__ import annotations

import itertools
import math
import re
from array import array
from typing import Any, NamedTuple

from stagerd.contract import dtypes
from stagerd.errors import DTypeError, HeaderError, StagerdError

MAX_NDIM = 64
_I64_MAX = (1 << 63) - 1


class TensorEntry(NamedTuple):
    """One tensor in a safetensors file: dtype name, shape, and [begin, end) relative to the data section.

    A named tuple, not a frozen dataclass: a shard of a 100k-tensor checkpoint makes 100k of these, and a
    frozen dataclass's `__init__` (an `object.__setattr__` per field) took 2.5x as long to build one."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


def header_error(path: object, msg: str) -> HeaderError:
    return HeaderError(msg, path=path)


def _utf8(text: str) -> bool:
    """JSON may decode to lone surrogates, which no safetensors writer can encode back."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def uints(xs: list[Any]) -> bool:
    """Whether every item is an int >= 0 (not a bool), without a generator and a call per item: headers
    of 100k tensors check three short lists per tensor, and that was a tenth of `verify --against`'s time."""
    for x in xs:  # noqa: SIM110 (all() over a generator is the cost avoided here)
        if type(x) is not int or x < 0:  # json gives exact ints; `type` also refuses bool
            return False
    return True


def empty_overflows(shape: list[int] | tuple[int, ...]) -> bool:
    """Whether safetensors' loader refuses this shape of no elements: it multiplies the dims left to
    right in 64 bits, so dims before the 0 whose product passes 2**64 fail the load (a file of a
    non-empty shape that large could not hold its bytes, which every reader checks)."""
    n = 1
    for d in shape:
        if d == 0:
            return False
        n *= d
        if n >= 1 << 64:
            return True
    return False


def check_metadata(path: object, info: Any) -> dict[str, str]:
    if not isinstance(info, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in info.items()
    ):
        raise header_error(path, "__metadata__ must map strings to strings")
    if not all(_utf8(k) and _utf8(v) for k, v in info.items()):
        raise header_error(path, "__metadata__ holds text that is not valid UTF-8")
    return dict(info)


def check_entry(path: object, name: str, info: Any, data_len: int) -> TensorEntry:
    """One tensor's entry, every field checked against the data section's length."""
    if not isinstance(info, dict):
        raise header_error(path, f"tensor {name!r}: entry is not an object")
    if not _utf8(name):
        raise header_error(path, f"tensor name {name!r} is not valid UTF-8")
    try:
        dtype_name, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    except KeyError as e:
        raise header_error(path, f"tensor {name!r}: missing {e.args[0]!r}") from None
    dt = _dtype(path, name, dtype_name)
    if not isinstance(shape, list) or len(shape) > MAX_NDIM or not uints(shape):
        raise header_error(path, f"tensor {name!r}: shape must be a list of non-negative integers")
    if not (isinstance(offsets, list) and len(offsets) == 2 and uints(offsets)):
        raise header_error(path, f"tensor {name!r}: data_offsets must be two non-negative integers")
    return _entry(path, name, dt, tuple(shape), offsets[0], offsets[1], data_len)


def _dtype(path: object, name: str, dtype_name: Any) -> dtypes.DType:
    try:
        return dtypes.lookup(dtype_name)
    except DTypeError:
        raise DTypeError(f"tensor {name!r}: unknown dtype {dtype_name!r}", path=path) from None


def _entry(
    path: object, name: str, dt: dtypes.DType, shape: tuple[int, ...], begin: int, end: int, data_len: int
) -> TensorEntry:
    if any(d > _I64_MAX for d in shape):  # no tensor has one; its size would not print (int's digit limit)
        raise header_error(path, f"tensor {name!r}: a shape dim is past 2^63 - 1")
    if begin > end or end > data_len:
        raise header_error(
            path,
            f"tensor {name!r}: data_offsets [{begin}, {end}] run past the {data_len}-byte data section"
            " (truncated?)"
            if end > data_len
            else f"tensor {name!r}: data_offsets [{begin}, {end}] are reversed",
        )
    try:
        want = dt.nbytes(math.prod(shape))
    except StagerdError:
        raise header_error(
            path, f"tensor {name!r}: shape {list(shape)} does not fill whole bytes of {dt.name}"
        ) from None
    if end - begin != want:
        raise header_error(
            path, f"tensor {name!r}: {end - begin} data bytes, but {dt.name}{list(shape)} needs {want}"
        )
    if not want and empty_overflows(shape):
        raise header_error(path, f"tensor {name!r}: shape {list(shape)} overflows 64 bits before its 0 dim")
    return TensorEntry(name, dt.name, shape, begin, end)


_KNOWN_PAIRS = 4096  # distinct (dtype, shape) pairs remembered per header: a hostile one may make each new


def matched_entry(
    path: object, name: str, m: re.Match[str], data_len: int, known: dict[tuple[str, str], TensorEntry]
) -> TensorEntry:
    """`check_entry` of an entry read by `json_members.ENTRY` (its form is checked): the same checks
    with the same errors; an entry of a (dtype, shape) pair seen before (`known`) needs only its
    offsets checked, and shares that entry's shape tuple."""
    _, dtype_name, shape_text, b, e, _ = m.groups()
    key = (dtype_name, shape_text or "")
    seen = known.get(key)
    try:  # as json.loads decodes them: past int()'s digit limit is a ValueError there too
        begin, end = int(b), int(e)
        shape = (
            seen.shape if seen is not None else tuple(map(int, shape_text.split(","))) if shape_text else ()
        )
    except ValueError as err:
        raise header_error(path, f"header is not valid UTF-8 JSON: {type(err).__name__}") from None
    if seen is not None and begin <= end <= data_len and end - begin == seen.end - seen.begin:
        return TensorEntry(name, seen.dtype, shape, begin, end)
    dt = _dtype(path, name, dtype_name)
    if len(shape) > MAX_NDIM:
        raise header_error(path, f"tensor {name!r}: shape must be a list of non-negative integers")
    t = _entry(path, name, dt, shape, begin, end, data_len)
    if len(known) < _KNOWN_PAIRS:
        known[key] = t
    return t


class Overlaps:
    """Finds two tensors sharing data bytes from two integers per tensor: pair by pair while the entries
    come in data order (as every writer puts them), else by one sort of the offsets at the end."""

    def __init__(self, path: object) -> None:
        self.path = path
        self.begin, self.end = array("q"), array("q")
        self.last: TensorEntry | None = None
        self.in_order = True

    def add(self, t: TensorEntry) -> None:
        if t.end == t.begin:
            return
        last = self.last
        if last is not None and self.in_order:
            if t.begin < last.begin:
                self.in_order = False
            elif t.begin < last.end:
                raise header_error(
                    self.path, f"tensors {last.name!r} and {t.name!r} overlap in the data section"
                )
        self.begin.append(t.begin)
        self.end.append(t.end)
        self.last = t

    def check(self) -> None:
        if self.in_order:
            return
        begin, end = self.begin, self.end
        order = sorted(range(len(begin)), key=begin.__getitem__)
        for a, b in itertools.pairwise(order):
            if begin[b] < end[a]:
                raise header_error(
                    self.path,
                    f"tensors at data_offsets [{begin[a]}, {end[a]}] and [{begin[b]}, {end[b]}] overlap"
                    " in the data section",
                )
