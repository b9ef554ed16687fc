"""The Xet formats the test CAS reads (xet-core's spec, `docs/` before 28dd7608): hash strings, shards (fixed
48-byte records), xorbs (chunks behind 8-byte headers) and the chunk compression schemes.

Test infrastructure only. Every length and offset is checked against the bytes before it is used: a malformed
body is a `XetFormatError`, which the CAS answers with a 400.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

RECORD = 48  # every shard record: header, file and CAS entries, bookends
SHARD_TAG = b"HFRepoMetaData\x00" + bytes(
    [85, 105, 103, 69, 106, 123, 129, 87, 131, 165, 189, 217, 92, 205, 209, 74, 169]
)
BOOKEND = b"\xff" * 32
FLAG_VERIFICATION = 1 << 31
FLAG_METADATA_EXT = 1 << 30
CHUNK_HEADER = 8
MAX_CHUNK = 128 * 1024
SCHEME_NONE, SCHEME_LZ4, SCHEME_BG4_LZ4 = 0, 1, 2


class XetFormatError(ValueError):
    """A shard or xorb that does not follow the format."""


def hash_hex(raw: bytes) -> str:
    """A 32-byte hash as the API prints it: four little-endian u64 words, each as 16 hex digits."""
    if len(raw) != 32:
        raise XetFormatError(f"a hash is 32 bytes, not {len(raw)}")
    return "".join(f"{w:016x}" for w in struct.unpack("<4Q", raw))


def hash_raw(text: str) -> bytes:
    """The inverse of `hash_hex`."""
    if len(text) != 64:
        raise XetFormatError(f"a hash string is 64 hex digits, not {len(text)}")
    try:
        return struct.pack("<4Q", *(int(text[i : i + 16], 16) for i in range(0, 64, 16)))
    except ValueError:
        raise XetFormatError(f"not a hash: {text!r}") from None


@dataclass(frozen=True)
class Term:
    """One term of a file reconstruction: chunks [start, end) of a xorb, `size` bytes once decompressed."""

    xorb: str
    start: int
    end: int
    size: int


@dataclass(frozen=True)
class FileInfo:
    """A file a shard registers: its Xet hash, the sha256 linking it to a commit's `lfsFile`, its terms."""

    file_hash: str
    sha256: str | None
    terms: tuple[Term, ...]

    @property
    def size(self) -> int:
        return sum(t.size for t in self.terms)


@dataclass(frozen=True)
class XorbInfo:
    """A xorb a shard lists: its hash, each chunk's (hash, offset into the raw bytes, size), sizes."""

    xorb: str
    chunks: tuple[tuple[str, int, int], ...]
    raw_bytes: int
    serialized_bytes: int


@dataclass(frozen=True)
class Shard:
    files: tuple[FileInfo, ...]
    xorbs: tuple[XorbInfo, ...]


class _Records:
    def __init__(self, data: bytes) -> None:
        self.data, self.at = data, 0

    def take(self) -> bytes:
        if self.at + RECORD > len(self.data):
            raise XetFormatError(f"shard ends inside a record at byte {self.at} of {len(self.data)}")
        rec = self.data[self.at : self.at + RECORD]
        self.at += RECORD
        return rec


def parse_shard(data: bytes) -> Shard:
    """Read an uploaded shard (header, file info section, CAS info section; the footer is omitted)."""
    recs = _Records(data)
    head = recs.take()
    if head[:32] != SHARD_TAG:
        raise XetFormatError("not a shard: bad magic tag")
    version, footer = struct.unpack("<QQ", head[32:])
    if version != 2:
        raise XetFormatError(f"shard header version {version}, expected 2")
    files = []
    while (rec := recs.take())[:32] != BOOKEND:
        flags, n = struct.unpack("<II", rec[32:40])
        terms = []
        for _ in range(n):
            e = recs.take()
            _cas_flags, size, start, end = struct.unpack("<IIII", e[32:])
            if not start < end:
                raise XetFormatError(f"file term with empty chunk range [{start}, {end})")
            terms.append(Term(hash_hex(e[:32]), start, end, size))
        if flags & FLAG_VERIFICATION:
            for _ in range(n):
                recs.take()  # one verification hash per term: needs blake3, not checked here
        # xet-core keeps the sha256 as one of its own hashes, so it too is four little-endian words
        sha256 = hash_hex(recs.take()[:32]) if flags & FLAG_METADATA_EXT else None
        files.append(FileInfo(hash_hex(rec[:32]), sha256, tuple(terms)))
    xorbs = []
    while (rec := recs.take())[:32] != BOOKEND:
        _flags, n, raw, on_disk = struct.unpack("<IIII", rec[32:])
        chunks = []
        for _ in range(n):
            e = recs.take()
            offset, size = struct.unpack("<II", e[32:40])
            chunks.append((hash_hex(e[:32]), offset, size))
        xorbs.append(XorbInfo(hash_hex(rec[:32]), tuple(chunks), raw, on_disk))
    if len(data) - recs.at != footer:
        left = len(data) - recs.at
        raise XetFormatError(f"{left} bytes after the CAS info section, footer_size says {footer}")
    return Shard(tuple(files), tuple(xorbs))


def chunk_offsets(xorb: bytes) -> list[int]:
    """Where each chunk of a serialized xorb starts, plus where the last one ends: the xorb is walked by
    its 8-byte chunk headers, up to its end or to the footer some writers append (its first byte is not
    chunk header version 0)."""
    offsets, at = [], 0
    while at + CHUNK_HEADER <= len(xorb) and xorb[at] == 0:
        compressed = int.from_bytes(xorb[at + 1 : at + 4], "little")
        scheme, size = xorb[at + 4], int.from_bytes(xorb[at + 5 : at + 8], "little")
        if scheme not in (SCHEME_NONE, SCHEME_LZ4, SCHEME_BG4_LZ4) or size > MAX_CHUNK:
            raise XetFormatError(f"bad chunk header at byte {at}: scheme {scheme}, {size} bytes")
        if at + CHUNK_HEADER + compressed > len(xorb):
            raise XetFormatError(f"chunk at byte {at} runs past the end of the xorb")
        offsets.append(at)
        at += CHUNK_HEADER + compressed
    if not offsets:
        raise XetFormatError("a xorb holds at least one chunk")
    return [*offsets, at]


def decode_chunks(xorb: bytes, offsets: list[int], start: int, end: int) -> bytes:
    """The decompressed bytes of chunks [start, end) of a serialized xorb."""
    out = bytearray()
    for i in range(start, end):
        at = offsets[i]
        compressed = int.from_bytes(xorb[at + 1 : at + 4], "little")
        scheme, size = xorb[at + 4], int.from_bytes(xorb[at + 5 : at + 8], "little")
        body = xorb[at + CHUNK_HEADER : at + CHUNK_HEADER + compressed]
        data = body if scheme == SCHEME_NONE else lz4_frame_decompress(body)
        if scheme == SCHEME_BG4_LZ4:
            data = bg4_regroup(data)
        if len(data) != size:
            raise XetFormatError(f"chunk {i} decompresses to {len(data)} bytes, its header says {size}")
        out += data
    return bytes(out)


def bg4_regroup(grouped: bytes) -> bytes:
    """Undo byte grouping: the data was split into 4 groups (byte i of every 4-byte word in group i)."""
    n = len(grouped)
    sizes = [n // 4 + (1 if i < n % 4 else 0) for i in range(4)]
    out = bytearray(n)
    at = 0
    for i, size in enumerate(sizes):
        out[i::4] = grouped[at : at + size]
        at += size
    return bytes(out)


def lz4_frame_decompress(frame: bytes) -> bytes:
    """LZ4 frame format (what xet-core writes with lz4_flex's FrameEncoder), blocks decoded in order."""
    if frame[:4] != b"\x04\x22\x4d\x18":
        raise XetFormatError("chunk is not an LZ4 frame")
    flg = frame[4]
    at = 7 + (8 if flg & 0x08 else 0) + (4 if flg & 0x01 else 0)  # FLG, BD, [content size], [dict id], HC
    out = bytearray()
    while True:
        if at + 4 > len(frame):
            raise XetFormatError("LZ4 frame ends without its end mark")
        (size,) = struct.unpack_from("<I", frame, at)
        at += 4
        if size == 0:
            return bytes(out)
        raw, size = bool(size & 0x80000000), size & 0x7FFFFFFF
        block = frame[at : at + size]
        if len(block) != size:
            raise XetFormatError("LZ4 block runs past the end of the frame")
        if raw:
            out += block
        else:
            _lz4_block(block, out)
        at += size + (4 if flg & 0x10 else 0)  # block checksum


def _lz4_block(src: bytes, out: bytearray) -> None:
    """Decode one LZ4 block onto `out`; matches may reach back into earlier blocks (linked mode)."""
    i, n = 0, len(src)
    while i < n:
        token = src[i]
        i += 1
        lit = token >> 4
        if lit == 15:
            while True:
                b = src[i]
                i += 1
                lit += b
                if b != 255:
                    break
        out += src[i : i + lit]
        i += lit
        if i >= n:
            return
        offset = src[i] | src[i + 1] << 8
        i += 2
        length = token & 15
        if length == 15:
            while True:
                b = src[i]
                i += 1
                length += b
                if b != 255:
                    break
        length += 4
        if not 0 < offset <= len(out):
            raise XetFormatError(f"LZ4 match offset {offset} outside the {len(out)} bytes decoded")
        start = len(out) - offset
        if offset >= length:
            out += out[start : start + length]
        else:
            pattern = bytes(out[start:])
            out += (pattern * (length // offset + 1))[:length]
