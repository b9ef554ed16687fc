"""Natural key order (`contract.sharding.natural_key`) with one small bytes key per name.

`natural_key` builds a tuple of strings and tuples per name, about 500 bytes; sorting 100k names holds all
of them at once (about 50 MB). `order_key` gives a bytes key of about the name's length that sorts the
same way (a test holds it to `natural_key` on hostile names), and `pack_in_natural_order` is
`contract.sharding.pack_by_size` on those keys.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Iterable, Mapping

_DIGITS = re.compile(r"(\d+)")  # the split natural_key makes: text, number, text, ..., text
_END = b"\x00"  # ends a text part: below every byte of an escaped character


def _text(part: str) -> bytes:
    """UTF-8 (whose byte order is code point order) with 0x00 and 0x01 escaped, then the end mark."""
    return part.encode().replace(b"\x01", b"\x01\x02").replace(b"\x00", b"\x01\x01") + _END


def _number(part: str) -> bytes:
    """natural_key's (digits without leading zeros: count, digits; then the full length), in bytes."""
    stripped = part.lstrip("0")
    return struct.pack(">I", len(stripped)) + stripped.encode() + struct.pack(">I", len(part))


def order_key(name: str) -> bytes:
    """A bytes key with `order_key(a) < order_key(b)` exactly when `natural_key(a) < natural_key(b)`."""
    return b"".join(_number(p) if i % 2 else _text(p) for i, p in enumerate(_DIGITS.split(name)))


def pack_in_natural_order(sizes: Mapping[str, int], max_shard_size: int) -> list[list[str]]:
    """`pack_by_size`: files filled up to `max_shard_size` in natural key order; an oversized tensor gets
    its own file."""
    return _pack(sorted(sizes, key=order_key), sizes, max_shard_size)


def _pack(names: Iterable[str], sizes: Mapping[str, int], max_size: int) -> list[list[str]]:
    files: list[list[str]] = []
    used = 0
    for name in names:
        if not files or (files[-1] and used + sizes[name] > max_size):
            files.append([])
            used = 0
        files[-1].append(name)
        used += sizes[name]
    return files
