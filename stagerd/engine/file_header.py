"""An output file's safetensors header, encoded tensor by tensor from the plan's arrays.

The bytes equal `contract.safetensors_format.encode_header` of the same entries with `{"format": "pt"}`
(a test holds them to it), without first building one dict per tensor: a 100k-tensor file's header is
written in one pass into one buffer, and `plan()` keeps only its size.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable, Iterator

from stagerd.engine.plan_types import ExportPlan

_OPEN = b'{"__metadata__":{"format":"pt"}'


def _pieces(entries: Iterable[tuple[str, str, tuple[int, ...], int, int]]) -> Iterator[bytes]:
    yield _OPEN
    for name, dtype, shape, begin, end in entries:
        yield (
            f',{json.dumps(name, ensure_ascii=False)}:{{"dtype":{json.dumps(dtype)},'
            f'"shape":[{",".join(map(str, shape))}],"data_offsets":[{begin},{end}]}}'
        ).encode()
    yield b"}"


def encode_entries(entries: Iterable[tuple[str, str, tuple[int, ...], int, int]]) -> bytearray:
    """The 8-byte length, the JSON header with `{"format": "pt"}`, then spaces up to an 8-byte boundary."""
    out = bytearray(8)  # the length goes here once it is known; one buffer, never copied
    for piece in _pieces(entries):
        out += piece
    out += b" " * (-len(out) % 8)
    struct.pack_into("<Q", out, 0, len(out) - 8)
    return out


def header_size(entries: Iterable[tuple[str, str, tuple[int, ...], int, int]]) -> int:
    """`len(encode_entries(entries))` without holding the header."""
    n = 8 + sum(len(piece) for piece in _pieces(entries))
    return n + (-n % 8)


def file_header(p: ExportPlan, file: int) -> bytearray:
    return encode_entries(p.entries(file))
