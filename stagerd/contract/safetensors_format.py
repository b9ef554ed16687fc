"""Strict reading and validation of safetensors headers, DCP sharding metadata, and header writing.

Pure Python. Nothing here trusts a length or an offset before checking it against the file: a hostile
header can claim any size, so reads are bounded by the real file size and `MAX_HEADER_BYTES`.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
import stat
import struct
from array import array
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from stagerd.contract import dtypes
from stagerd.contract.json_members import members
from stagerd.errors import DTypeError, HeaderError, StagerdError

# safetensors itself refuses headers above 100 MB; so do we.
MAX_HEADER_BYTES = 100_000_000
MAX_NDIM = 64
DCP_SHARDING_INFO_KEY = "DCP_SHARDING_INFO"
SAVED_OFFSETS_KEY = "saved_offsets"
METADATA_KEY = "__metadata__"


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


@dataclass(frozen=True)
class Header:
    """A validated safetensors header. `data_start` is the absolute file offset of the data section."""

    path: str
    file_size: int
    data_start: int
    tensors: dict[str, TensorEntry]
    metadata: dict[str, str] = field(default_factory=dict)

    def dcp_offsets(self) -> dict[str, tuple[int, ...]]:
        """The `saved_offsets` of every tensor, from `__metadata__.DCP_SHARDING_INFO`."""
        return parse_dcp_sharding_info(self)


def _fail(path: object, msg: str) -> HeaderError:
    return HeaderError(msg, path=path)


def _utf8(text: str) -> bool:
    """JSON may decode to lone surrogates, which no safetensors writer can encode back."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _is_uint(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _uints(xs: list[Any]) -> bool:
    """`all(_is_uint(x) for x in xs)` without a generator and a call per item: headers of 100k tensors
    check three short lists per tensor, and that was a tenth of `verify --against`'s time."""
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


def _check_length(path: object, n: int, file_size: int) -> None:
    if n > MAX_HEADER_BYTES:
        raise _fail(path, f"header length {n} exceeds the {MAX_HEADER_BYTES}-byte limit (corrupt or hostile)")
    if 8 + n > file_size:
        raise _fail(path, f"header length {n} runs past the end of the {file_size}-byte file (truncated?)")


def parse_header_bytes(path: object, prefix: bytes, file_size: int) -> tuple[int, dict[str, Any]]:
    """Validate the 8-byte length and decode the JSON header. `prefix` holds at least 8+len bytes."""
    if file_size < 8 or len(prefix) < 8:
        raise _fail(path, f"file is {file_size} bytes, too short for a safetensors header")
    (n,) = struct.unpack("<Q", prefix[:8])
    _check_length(path, n, file_size)
    raw = prefix[8 : 8 + n]
    if len(raw) != n:
        raise _fail(path, "short read of the header")
    try:
        text = raw.decode("utf-8")
        obj = json.loads(text)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise _fail(path, f"header is not valid UTF-8 JSON: {type(e).__name__}") from None
    if not isinstance(obj, dict):
        raise _fail(path, "header is not a JSON object")
    return n, obj


def _check_metadata(path: object, info: Any) -> dict[str, str]:
    if not isinstance(info, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in info.items()
    ):
        raise _fail(path, "__metadata__ must map strings to strings")
    if not all(_utf8(k) and _utf8(v) for k, v in info.items()):
        raise _fail(path, "__metadata__ holds text that is not valid UTF-8")
    return dict(info)


def _check_entry(path: object, name: str, info: Any, data_len: int) -> TensorEntry:
    """One tensor's entry, every field checked against the data section's length."""
    if not isinstance(info, dict):
        raise _fail(path, f"tensor {name!r}: entry is not an object")
    if not _utf8(name):
        raise _fail(path, f"tensor name {name!r} is not valid UTF-8")
    try:
        dtype_name, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    except KeyError as e:
        raise _fail(path, f"tensor {name!r}: missing {e.args[0]!r}") from None
    dt = _dtype(path, name, dtype_name)
    if not isinstance(shape, list) or len(shape) > MAX_NDIM or not _uints(shape):
        raise _fail(path, f"tensor {name!r}: shape must be a list of non-negative integers")
    if not (isinstance(offsets, list) and len(offsets) == 2 and _uints(offsets)):
        raise _fail(path, f"tensor {name!r}: data_offsets must be two non-negative integers")
    return _entry(path, name, dt, tuple(shape), offsets[0], offsets[1], data_len)


def _dtype(path: object, name: str, dtype_name: Any) -> dtypes.DType:
    try:
        return dtypes.lookup(dtype_name)
    except DTypeError:
        raise DTypeError(f"tensor {name!r}: unknown dtype {dtype_name!r}", path=path) from None


def _entry(
    path: object, name: str, dt: dtypes.DType, shape: tuple[int, ...], begin: int, end: int, data_len: int
) -> TensorEntry:
    if begin > end or end > data_len:
        raise _fail(
            path,
            f"tensor {name!r}: data_offsets [{begin}, {end}] run past the {data_len}-byte data section"
            " (truncated?)"
            if end > data_len
            else f"tensor {name!r}: data_offsets [{begin}, {end}] are reversed",
        )
    try:
        want = dt.nbytes(math.prod(shape))
    except StagerdError:
        raise _fail(
            path, f"tensor {name!r}: shape {list(shape)} does not fill whole bytes of {dt.name}"
        ) from None
    if end - begin != want:
        raise _fail(
            path, f"tensor {name!r}: {end - begin} data bytes, but {dt.name}{list(shape)} needs {want}"
        )
    if not want and empty_overflows(shape):
        raise _fail(path, f"tensor {name!r}: shape {list(shape)} overflows 64 bits before its 0 dim")
    return TensorEntry(name, dt.name, shape, begin, end)


_KNOWN_PAIRS = 4096  # distinct (dtype, shape) pairs remembered per header: a hostile one may make each new


def _matched_entry(
    path: object, name: str, m: re.Match[str], data_len: int, known: dict[tuple[str, str], TensorEntry]
) -> TensorEntry:
    """`_check_entry` of an entry read by `json_members.ENTRY` (its form is checked): the same checks
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
        raise _fail(path, f"header is not valid UTF-8 JSON: {type(err).__name__}") from None
    if seen is not None and begin <= end <= data_len and end - begin == seen.end - seen.begin:
        return TensorEntry(name, seen.dtype, shape, begin, end)
    dt = _dtype(path, name, dtype_name)
    if len(shape) > MAX_NDIM:
        raise _fail(path, f"tensor {name!r}: shape must be a list of non-negative integers")
    t = _entry(path, name, dt, shape, begin, end, data_len)
    if len(known) < _KNOWN_PAIRS:
        known[key] = t
    return t


class _Overlaps:
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
                raise _fail(self.path, f"tensors {last.name!r} and {t.name!r} overlap in the data section")
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
                raise _fail(
                    self.path,
                    f"tensors at data_offsets [{begin[a]}, {end[a]}] and [{begin[b]}, {end[b]}] overlap"
                    " in the data section",
                )


def validate_header(path: object, n: int, obj: dict[str, Any], file_size: int) -> Header:
    """Check every entry of a decoded header against the file; return the typed Header."""
    data_start = 8 + n
    data_len = file_size - data_start
    metadata: dict[str, str] = {}
    tensors: dict[str, TensorEntry] = {}
    for name, info in obj.items():
        if name == METADATA_KEY:
            metadata = _check_metadata(path, info)
            continue
        tensors[name] = _check_entry(path, name, info, data_len)
    ordered = sorted((t for t in tensors.values() if t.end > t.begin), key=lambda t: t.begin)
    for a, b in itertools.pairwise(ordered):
        if b.begin < a.end:
            raise _fail(path, f"tensors {a.name!r} and {b.name!r} overlap in the data section")
    return Header(str(path), file_size, data_start, tensors, metadata)


class HeaderStream:
    """A file's header, decoded and checked one entry at a time: the JSON object's members are taken one
    by one by the stdlib's own decoder, so no tree of the whole header is ever built. The header's text
    is held (bounded by `MAX_HEADER_BYTES`); offsets are trustworthy only once `entries()` has finished,
    which is when tensors sharing bytes are found."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = path
        self.metadata: dict[str, str] = {}
        self.file_size, n, self._text = _read_text(path)
        self.data_start = 8 + n

    def entries(self) -> Iterator[TensorEntry]:
        """Every tensor entry in header order, each checked; `metadata` is set once they are all read."""
        path, data_len = self.path, self.file_size - self.data_start
        overlaps = _Overlaps(path)
        known: dict[tuple[str, str], TensorEntry] = {}
        for name, info in members(path, self._text):
            if name == METADATA_KEY:
                self.metadata = _check_metadata(path, info)
                continue
            if type(info) is re.Match:
                t = _matched_entry(path, name, info, data_len, known)
            else:
                t = _check_entry(path, name, info, data_len)
            overlaps.add(t)
            yield t
        overlaps.check()
        self._text = ""


def _read_text(path: str | os.PathLike[str]) -> tuple[int, int, str]:
    """(file size, header length, header text), every length checked against the file before reading."""
    from stagerd.errors import ShardError, open_failed

    try:
        # O_NONBLOCK: opening a FIFO planted in the staging dir must not hang the daemon.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise ShardError("shard file is missing", path=path) from None
    except IsADirectoryError:
        raise _fail(path, "is a directory, not a safetensors file") from None
    except OSError as e:
        raise open_failed(e, path, ShardError) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _fail(path, "is not a regular file")
        file_size = st.st_size
        head = os.pread(fd, 8, 0)
        if len(head) < 8:
            raise _fail(path, f"file is {file_size} bytes, too short for a safetensors header")
        (n,) = struct.unpack("<Q", head)
        _check_length(path, n, file_size)
        raw = os.pread(fd, n, 8)
    finally:
        os.close(fd)
    if len(raw) != n:
        raise _fail(path, "short read of the header")
    try:
        return file_size, n, raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _fail(path, f"header is not valid UTF-8 JSON: {type(e).__name__}") from None


def read_header(path: str | os.PathLike[str]) -> Header:
    """Read and validate the header of a safetensors file."""
    s = HeaderStream(path)
    tensors: dict[str, TensorEntry] = {}
    count = 0
    for t in s.entries():
        tensors[t.name] = t
        count += 1
    if count != len(tensors):
        raise _fail(path, f"{count - len(tensors)} tensor names appear twice in the header")
    return Header(str(path), s.file_size, s.data_start, tensors, s.metadata)


def parse_dcp_sharding_info(header: Header) -> dict[str, tuple[int, ...]]:
    """Validate `__metadata__.DCP_SHARDING_INFO` and return {name: saved_offsets} for every tensor."""
    raw = header.metadata.get(DCP_SHARDING_INFO_KEY)
    if raw is None:
        raise _fail(
            header.path,
            "no __metadata__.DCP_SHARDING_INFO: not a HuggingFaceStorageWriter(save_distributed=True) shard",
        )
    try:
        info = json.loads(raw)
    except (ValueError, RecursionError):
        raise _fail(header.path, "DCP_SHARDING_INFO is not valid JSON") from None
    if not isinstance(info, dict):
        raise _fail(header.path, "DCP_SHARDING_INFO is not a JSON object")
    out: dict[str, tuple[int, ...]] = {}
    for name, entry in header.tensors.items():
        item = info.get(name)
        if not isinstance(item, dict) or SAVED_OFFSETS_KEY not in item:
            raise _fail(header.path, f"tensor {name!r} has no saved_offsets in DCP_SHARDING_INFO")
        offs = item[SAVED_OFFSETS_KEY]
        if not isinstance(offs, list) or not _uints(offs):
            raise _fail(header.path, f"tensor {name!r}: saved_offsets must be non-negative integers")
        if len(offs) != len(entry.shape):
            raise _fail(
                header.path, f"tensor {name!r}: {len(offs)} saved_offsets for a {len(entry.shape)}-dim tensor"
            )
        out[name] = tuple(offs)
    extra = set(info) - set(header.tensors)
    if extra:
        raise _fail(header.path, f"DCP_SHARDING_INFO names tensors absent from the file: {sorted(extra)[:3]}")
    return out


def encode_header(
    entries: Mapping[str, tuple[str, tuple[int, ...], int, int]], metadata: Mapping[str, str]
) -> bytes:
    """The 8-byte length plus JSON header, padded with spaces so the data section starts 8-aligned.

    `entries` maps name -> (dtype, shape, begin, end), in the order they should appear.
    """
    obj: dict[str, Any] = {METADATA_KEY: dict(metadata)} if metadata else {}
    for name, (dtype, shape, begin, end) in entries.items():
        obj[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [begin, end]}
    body = json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    body += b" " * (-(8 + len(body)) % 8)
    return struct.pack("<Q", len(body)) + body


def find_shards(src: Path) -> list[Path]:
    """The `*.safetensors` files of a shard directory, sorted by name."""
    return sorted(p for p in src.iterdir() if p.name.endswith(".safetensors") and not p.name.startswith("."))
