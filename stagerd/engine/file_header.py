"""An output file's safetensors header, encoded tensor by tensor from the plan's arrays.

The bytes equal `contract.safetensors_format.encode_header` of the same entries with `{"format": "pt"}`
(a test holds them to it), without first building one dict per tensor: a 100k-tensor file's header is
written in one pass into one buffer, and `plan()` keeps only its size.
"""

from __future__ import annotations

import json
import re
import struct
from array import array
from collections.abc import Callable, Iterable, Iterator

import numpy as np

from stagerd.contract.safetensors_format import HeaderStream
from stagerd.engine.plan_types import DTYPE_NAMES, ExportPlan, Names
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


# an entry's bytes besides its name, dtype, shape and offsets (the three digits of this one)
_FIXED = len(next(p for p in _pieces([("", "", (0,), 0, 0)]) if p != _OPEN)) - 3
_POW10 = np.array([10**k for k in range(1, 19)], dtype=np.int64)
_ESCAPED = re.compile(rb'[\x00-\x1f"\\]')  # what encode_basestring writes otherwise than as itself
_DTYPE_LEN = np.array([len(n) for n in DTYPE_NAMES], dtype=np.int64)


_ROWS = 16384  # rows per numpy pass: a few arrays of this length, whatever the file holds


def rows_header_size(
    names: Names, dims: array, shape_at: array, shape_ndim: array, rows: tuple[array, array, array, array]
) -> int | None:
    """`header_size` of the plan rows `rows` (tensor, output dtype, begin, end) from the arrays, in
    numpy passes (the entries one by one were a tenth of a second per 100k tensors); None where a name
    needs escaping in JSON (then `header_size` counts it)."""
    if _ESCAPED.search(names.blob):
        return None
    name_end = np.frombuffer(names.end, dtype=np.int64)
    all_dims = np.frombuffer(dims, dtype=np.int64)
    n = 8 + len(_OPEN) + 1 + len(rows[0]) * _FIXED
    for lo in range(0, len(rows[0]), _ROWS):
        tensor, dst, begin, end = (np.frombuffer(a, dtype=a.typecode)[lo : lo + _ROWS] for a in rows)
        tensor = tensor.astype(np.int64)
        n += int((name_end[tensor] - np.where(tensor > 0, name_end[tensor - 1], 0)).sum())
        n += int(_DTYPE_LEN[dst].sum())
        n += 2 * len(tensor) + int(_ten_powers(begin).sum() + _ten_powers(end).sum())  # digits
        at = np.frombuffer(shape_at, dtype=np.int64)[tensor]
        nd = np.frombuffer(shape_ndim, dtype=np.uint8)[tensor]
        for d in range(int(nd.max(initial=0))):  # a shape's digits and the commas between them
            has = nd > d
            n += int((_ten_powers(all_dims[at[has] + d]) + 1 + (d > 0)).sum())
    return n + (-n % 8)


def _ten_powers(x: np.ndarray) -> np.ndarray:
    """The number of digits of each of `x` (all non-negative) less one."""
    return np.searchsorted(_POW10, x, "right")


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
