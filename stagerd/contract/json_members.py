"""A safetensors header's JSON object taken member by member, without a tree of the whole header.

Each member is decoded by the stdlib's own scanner, except a tensor entry in the form every writer puts
it in (`"name":{"dtype":"F32","shape":[2,8],"data_offsets":[0,64]}`, any JSON whitespace): that is one
regular-expression match, handed over as the `re.Match` (`ENTRY`'s groups: name, dtype, the shape's
integers as written, begin, end). At 100k tensors per header, three calls per member into the scanner
and its delimiters were most of reading a header. The match accepts only text that `json.loads` reads
to the same entry: names and dtypes without escapes or control characters, integers as JSON writes
them; anything else (an escape, a float, a fourth key, another key order) goes to the scanner.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from json.decoder import scanstring  # type: ignore[attr-defined]
from typing import Any

from stagerd.contract.header_entries import MAX_NDIM
from stagerd.errors import HeaderError

_W = r"[ \t\n\r]*"  # JSON's whitespace, as the stdlib decoder takes it
_UINT = r"(?:0|[1-9][0-9]*)"
_PLAIN = r'"([^"\\\x00-\x1f]*)"'  # a string that decodes to its own text

ENTRY = re.compile(
    rf"{_PLAIN}{_W}:{_W}\{{{_W}"
    rf'"dtype"{_W}:{_W}{_PLAIN}{_W},{_W}'
    # at most MAX_NDIM dims: an unbounded repeat keeps backtracking state per dim (GBs for a 100 MB
    # header); a longer shape goes to the scanner, which the entry's own checks then refuse
    rf'"shape"{_W}:{_W}\[{_W}({_UINT}(?:{_W},{_W}{_UINT}){{0,{MAX_NDIM - 1}}})?{_W}\]{_W},{_W}'
    rf'"data_offsets"{_W}:{_W}\[{_W}({_UINT}){_W},{_W}({_UINT}){_W}\]{_W}\}}'
    rf"{_W}([,}}]){_W}"
)
_WS = re.compile(_W)
_COLON = re.compile(rf"{_W}:{_W}")
_NEXT = re.compile(rf"{_W}([,}}]){_W}")
_SCAN = json.JSONDecoder().scan_once  # type: ignore[attr-defined]  # json.loads's own C scanner


def members(path: object, text: str) -> Iterator[tuple[str, Any]]:
    """The (name, value) members of the JSON object `text`, in order, each value decoded on its own, or
    an `ENTRY` match in place of the value where the member has that form.

    Accepts exactly what `json.loads` accepts as an object (the same whitespace, strings and values:
    each is the stdlib decoder's work); where it would give something else, it is a `HeaderError`."""
    entry = ENTRY.match
    try:
        i = _skip(text, 0)
        if text[i : i + 1] != "{":
            json.loads(text)  # raises for what is not JSON
            raise HeaderError("header is not a JSON object", path=path)
        i = _skip(text, i + 1)
        if text[i : i + 1] == "}":
            i = _skip(text, i + 1)
        else:
            while True:
                m = entry(text, i)
                if m is not None:
                    yield m.group(1), m
                    i = m.end()
                    if m.group(6) == "}":
                        break
                    continue
                if text[i : i + 1] != '"':
                    raise json.JSONDecodeError("Expecting property name enclosed in double quotes", text, i)
                name, i = scanstring(text, i + 1, True)
                m = _COLON.match(text, i)
                if m is None:
                    raise json.JSONDecodeError("Expecting ':' delimiter", text, i)
                try:
                    value, i = _SCAN(text, m.end())
                except StopIteration as e:
                    raise json.JSONDecodeError("Expecting value", text, e.value) from None
                yield name, value
                m = _NEXT.match(text, i)
                if m is None:
                    raise json.JSONDecodeError("Expecting ',' delimiter", text, i)
                i = m.end()
                if m.group(1) == "}":
                    break
        if i != len(text):
            raise json.JSONDecodeError("Extra data", text, i)
    except (ValueError, RecursionError) as e:
        raise HeaderError(f"header is not valid UTF-8 JSON: {type(e).__name__}", path=path) from None


def _skip(text: str, i: int) -> int:
    """The index of the first character from `i` on that is not JSON whitespace."""
    m = _WS.match(text, i)
    return i if m is None else m.end()
