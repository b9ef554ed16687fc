"""An output file's safetensors header, encoded tensor by tensor from the plan's arrays.

The bytes equal `contract.safetensors_format.encode_header` of the same entries with `{"format": "pt"}`
(a test holds them to it), without first building one dict per tensor: a 100k-tensor file's header is
written in one pass into one buffer, and `plan()` keeps only its size.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable

from stagerd.engine.plan_types import ExportPlan

_OPEN = b'{"__metadata__":{"format":"pt"}'


def encode_entries(entries: Iterable[tuple[str, str, tuple[int, ...], int, int]]) -> bytes:
    """The 8-byte length, the JSON header with `{"format": "pt"}`, then spaces up to an 8-byte boundary."""
    body = bytearray(_OPEN)
    for name, dtype, shape, begin, end in entries:
        body += (
            f',{json.dumps(name, ensure_ascii=False)}:{{"dtype":{json.dumps(dtype)},'
            f'"shape":[{",".join(map(str, shape))}],"data_offsets":[{begin},{end}]}}'
        ).encode()
    body += b"}"
    body += b" " * (-(8 + len(body)) % 8)
    return struct.pack("<Q", len(body)) + bytes(body)


def file_header(p: ExportPlan, file: int) -> bytes:
    return encode_entries(p.entries(file))
