"""Natural key order (`contract.sharding.natural_key`) with one small bytes key per name.

`natural_key` builds a tuple of strings and tuples per name, about 500 bytes; sorting 100k names holds all
of them at once (about 50 MB). `order_key` gives a bytes key of about the name's length that sorts the
same way (a test holds it to `natural_key` on hostile names); `pack_in_natural_order` and
`assign_in_natural_order` are `contract.sharding`'s `pack_by_size` and `assign_with_reference` on those
keys (tests hold them equal), which stay the definition of how tensors are assigned to files.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Iterable, Mapping

from stagerd.contract.sharding import reference_file_order
from stagerd.errors import ReferenceIndexError

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
    if name.isascii():  # in ASCII `\d` is 0-9 alone: one pass over the bytes, the same key
        b = name.encode()
        if b"\x00" in b or b"\x01" in b:
            b = b.replace(b"\x01", b"\x01\x02").replace(b"\x00", b"\x01\x01")
        return _ASCII_DIGITS.sub(_ascii_number, b) + _END
    return b"".join(_number(p) if i % 2 else _text(p) for i, p in enumerate(_DIGITS.split(name)))


_ASCII_DIGITS = re.compile(rb"[0-9]+")


def _ascii_number(m: re.Match[bytes]) -> bytes:
    """`_END` (closing the text before) and `_number` of the digits: the text parts escape as a whole."""
    digits = m.group()
    stripped = digits.lstrip(b"0")
    return _END + struct.pack(">I", len(stripped)) + stripped + struct.pack(">I", len(digits))


def pack_in_natural_order(sizes: Mapping[str, int], max_shard_size: int) -> list[list[str]]:
    """`pack_by_size`: files filled up to `max_shard_size` in natural key order; an oversized tensor gets
    its own file."""
    return _pack(sorted(sizes, key=order_key), sizes, max_shard_size, [])


def assign_in_natural_order(
    sizes: Mapping[str, int], weight_map: Mapping[str, str], max_shard_size: int, *, ordered: bool = True
) -> list[list[str]]:
    """`assign_with_reference`: the reference's files in its order, each in natural key order; keys it
    lacks packed into the last file, then new ones; reference keys absent from the shards are an error.
    `ordered=False` leaves each reference file's keys in the reference's order: the same files, for a
    caller that orders each file's keys itself (a sort key per name is the dearest part)."""
    missing = [k for k in weight_map if k not in sizes]
    if missing:
        missing.sort(key=order_key)
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise ReferenceIndexError(
            f"{len(missing)} tensors of the reference index are not in the shards: {missing[:5]}{more}"
        )
    groups: dict[str, list[str]] = {}
    for key, fname in weight_map.items():
        groups.setdefault(fname, []).append(key)
    files = [
        sorted(groups.pop(f), key=order_key) if ordered else groups.pop(f)
        for f in reference_file_order(list(groups))
    ]
    extra = sorted((k for k in sizes if k not in weight_map), key=order_key)
    return _pack(extra, sizes, max_shard_size, files)


def _pack(
    names: Iterable[str], sizes: Mapping[str, int], max_size: int, files: list[list[str]]
) -> list[list[str]]:
    """Greedy fill in the given order, from the last of `files`: a new file when the next would overflow."""
    used = sum(sizes[n] for n in files[-1]) if files else 0
    for name in names:
        if not files or (files[-1] and used + sizes[name] > max_size):
            files.append([])
            used = 0
        files[-1].append(name)
        used += sizes[name]
    return files
