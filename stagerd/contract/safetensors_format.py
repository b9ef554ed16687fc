"""Strict reading of safetensors headers (each entry checked by `header_entries.py`), DCP sharding
metadata, and header writing.

Pure Python. Nothing here trusts a length or an offset before checking it against the file: a hostile
header can claim any size, so reads are bounded by the real file size and `MAX_HEADER_BYTES`.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import stat
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stagerd.contract.header_entries import (
    Overlaps,
    TensorEntry,
    check_entry,
    check_metadata,
    header_error,
    matched_entry,
    uints,
)
from stagerd.contract.json_members import members

# safetensors itself refuses headers above 100 MB; so do we.
MAX_HEADER_BYTES = 100_000_000
DCP_SHARDING_INFO_KEY = "DCP_SHARDING_INFO"
SAVED_OFFSETS_KEY = "saved_offsets"
METADATA_KEY = "__metadata__"


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


def _check_length(path: object, n: int, file_size: int) -> None:
    if n > MAX_HEADER_BYTES:
        raise header_error(
            path, f"header length {n} exceeds the {MAX_HEADER_BYTES}-byte limit (corrupt or hostile)"
        )
    if 8 + n > file_size:
        raise header_error(
            path, f"header length {n} runs past the end of the {file_size}-byte file (truncated?)"
        )


def parse_header_bytes(path: object, prefix: bytes, file_size: int) -> tuple[int, dict[str, Any]]:
    """Validate the 8-byte length and decode the JSON header. `prefix` holds at least 8+len bytes."""
    if file_size < 8 or len(prefix) < 8:
        raise header_error(path, f"file is {file_size} bytes, too short for a safetensors header")
    (n,) = struct.unpack("<Q", prefix[:8])
    _check_length(path, n, file_size)
    raw = prefix[8 : 8 + n]
    if len(raw) != n:
        raise header_error(path, "short read of the header")
    try:
        text = raw.decode("utf-8")
        obj = json.loads(text)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise header_error(path, f"header is not valid UTF-8 JSON: {type(e).__name__}") from None
    if not isinstance(obj, dict):
        raise header_error(path, "header is not a JSON object")
    return n, obj


def validate_header(path: object, n: int, obj: dict[str, Any], file_size: int) -> Header:
    """Check every entry of a decoded header against the file; return the typed Header."""
    data_start = 8 + n
    data_len = file_size - data_start
    metadata: dict[str, str] = {}
    tensors: dict[str, TensorEntry] = {}
    for name, info in obj.items():
        if name == METADATA_KEY:
            metadata = check_metadata(path, info)
            continue
        tensors[name] = check_entry(path, name, info, data_len)
    ordered = sorted((t for t in tensors.values() if t.end > t.begin), key=lambda t: t.begin)
    for a, b in itertools.pairwise(ordered):
        if b.begin < a.end:
            raise header_error(path, f"tensors {a.name!r} and {b.name!r} overlap in the data section")
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
        overlaps = Overlaps(path)
        known: dict[tuple[str, str], TensorEntry] = {}
        for name, info in members(path, self._text):
            if name == METADATA_KEY:
                self.metadata = check_metadata(path, info)
                continue
            if type(info) is re.Match:
                t = matched_entry(path, name, info, data_len, known)
            else:
                t = check_entry(path, name, info, data_len)
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
        raise header_error(path, "is a directory, not a safetensors file") from None
    except OSError as e:
        raise open_failed(e, path, ShardError) from None
    except ValueError:  # a NUL in a name read from a file (an index): no file has it
        raise ShardError("a file name with a NUL byte", path=repr(str(path))) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise header_error(path, "is not a regular file")
        file_size = st.st_size
        head = os.pread(fd, 8, 0)
        if len(head) < 8:
            raise header_error(path, f"file is {file_size} bytes, too short for a safetensors header")
        (n,) = struct.unpack("<Q", head)
        _check_length(path, n, file_size)
        raw = os.pread(fd, n, 8)
    finally:
        os.close(fd)
    if len(raw) != n:
        raise header_error(path, "short read of the header")
    try:
        return file_size, n, raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise header_error(path, f"header is not valid UTF-8 JSON: {type(e).__name__}") from None


def read_header(path: str | os.PathLike[str]) -> Header:
    """Read and validate the header of a safetensors file."""
    s = HeaderStream(path)
    tensors: dict[str, TensorEntry] = {}
    count = 0
    for t in s.entries():
        tensors[t.name] = t
        count += 1
    if count != len(tensors):
        raise header_error(path, f"{count - len(tensors)} tensor names appear twice in the header")
    return Header(str(path), s.file_size, s.data_start, tensors, s.metadata)


def parse_dcp_sharding_info(header: Header) -> dict[str, tuple[int, ...]]:
    """Validate `__metadata__.DCP_SHARDING_INFO` and return {name: saved_offsets} for every tensor."""
    raw = header.metadata.get(DCP_SHARDING_INFO_KEY)
    if raw is None:
        raise header_error(
            header.path,
            "no __metadata__.DCP_SHARDING_INFO: not a HuggingFaceStorageWriter(save_distributed=True) shard",
        )
    try:
        info = json.loads(raw)
    except (ValueError, RecursionError):
        raise header_error(header.path, "DCP_SHARDING_INFO is not valid JSON") from None
    if not isinstance(info, dict):
        raise header_error(header.path, "DCP_SHARDING_INFO is not a JSON object")
    out: dict[str, tuple[int, ...]] = {}
    for name, entry in header.tensors.items():
        item = info.get(name)
        if not isinstance(item, dict) or SAVED_OFFSETS_KEY not in item:
            raise header_error(header.path, f"tensor {name!r} has no saved_offsets in DCP_SHARDING_INFO")
        offs = item[SAVED_OFFSETS_KEY]
        if not isinstance(offs, list) or not uints(offs):
            raise header_error(header.path, f"tensor {name!r}: saved_offsets must be non-negative integers")
        if len(offs) != len(entry.shape):
            raise header_error(
                header.path, f"tensor {name!r}: {len(offs)} saved_offsets for a {len(entry.shape)}-dim tensor"
            )
        out[name] = tuple(offs)
    extra = set(info) - set(header.tensors)
    if extra:
        raise header_error(
            header.path, f"DCP_SHARDING_INFO names tensors absent from the file: {sorted(extra)[:3]}"
        )
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
