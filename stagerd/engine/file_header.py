"""An output file's safetensors header, encoded tensor by tensor from the plan's arrays.

The bytes equal `contract.safetensors_format.encode_header` of the same entries with `{"format": "pt"}`
(a test holds them to it), without first building one dict per tensor: a 100k-tensor file's header is
written in one pass into one buffer, and `plan()` keeps only its size.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Iterable, Iterator

from stagerd.contract.safetensors_format import HeaderStream
from stagerd.engine.plan_types import ExportPlan
from stagerd.errors import StagerdError

_OPEN = b'{"__metadata__":{"format":"pt"}'


def _pieces(entries: Iterable[tuple[str, str, tuple[int, ...], int, int]]) -> Iterator[bytes]:
    yield _OPEN
    for name, dtype, shape, begin, end in entries:
        # encode_basestring is what json.dumps(name, ensure_ascii=False) calls, without its per-call setup
        yield (
            f',{_quote(name)}:{{"dtype":{_quote(dtype)},'
            f'"shape":[{",".join(map(str, shape))}],"data_offsets":[{begin},{end}]}}'
        ).encode()
    yield b"}"


_quote: Callable[[str], str] = json.encoder.encode_basestring


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


def header_difference(p: ExportPlan, file: int, path: str) -> str:
    """What the header of the export file `path` says otherwise than the one `p` gives for `file`, in
    one line: the first tensor that differs, by name, with both sides. Both are streamed."""
    try:
        s = HeaderStream(path)
        got = s.entries()
        for name, dtype, shape, begin, end in p.entries(file):
            t = next(got, None)
            if t is None:
                return f"the header ends before {name!r}, which the source puts in this file"
            if t.name != name:
                return f"the header lists {t.name!r} where the source gives {name!r}"
            if (t.dtype, tuple(t.shape)) != (dtype, shape):
                return (
                    f"tensor {name!r} is {t.dtype} of shape {list(t.shape)}, the source gives {dtype} of"
                    f" shape {list(shape)}"
                )
            if (t.begin, t.end) != (begin, end):
                at = f"[{t.begin}, {t.end})"
                return f"tensor {name!r} lies at data bytes {at}, the source gives [{begin}, {end})"
        extra = next(got, None)
        if extra is not None:
            return f"the header lists {extra.name!r}, which the source does not put in this file"
        if s.metadata != {"format": "pt"}:
            return f'the header\'s __metadata__ is {s.metadata}, the source gives {{"format": "pt"}}'
    except StagerdError as e:
        return f"invalid header: {e.message}"
    return "header differs from the one the source gives (in its spacing)"
