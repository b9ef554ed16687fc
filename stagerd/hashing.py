"""Streaming sha256: hash bytes on their way somewhere, so a file is read once.

`PartHasher` keeps the whole-file sha256 (the manifest's) and, when asked, one sha256 per upload part, from
which it derives the S3 composite checksum (`base64(sha256(d1 || d2 || ...))-N`) that a store reports for a
multipart object uploaded with `ChecksumAlgorithm=SHA256`.
"""

from __future__ import annotations

import base64
import hashlib
import os
from collections.abc import Iterator
from dataclasses import dataclass

CHUNK = 8 << 20


def b64_sha256(data: bytes | memoryview) -> str:
    """The base64 sha256 of `data`, as S3's `x-amz-checksum-sha256` carries it."""
    return base64.b64encode(hashlib.sha256(data).digest()).decode()


def composite_sha256(part_digests: list[bytes]) -> str:
    """The S3 composite checksum of a multipart object from its parts' raw sha256 digests."""
    return f"{base64.b64encode(hashlib.sha256(b''.join(part_digests)).digest()).decode()}-{len(part_digests)}"


@dataclass(frozen=True)
class FileDigest:
    """sha256 hex of a whole file, its size, and the store checksum it gets with `part_size` parts."""

    size: int
    sha256: str
    checksum: str


def store_checksum(whole_digest: bytes, part_digests: list[bytes], multipart: bool) -> str:
    """What an S3-like store reports: the plain base64 sha256 for one PUT, the composite for multipart."""
    if multipart:
        return composite_sha256(part_digests)
    return base64.b64encode(whole_digest).decode()


def iter_file(path: str | os.PathLike[str], chunk: int = CHUNK) -> Iterator[memoryview]:
    """Yield the bytes of `path` in order through one reused buffer; a view is valid until the next one."""
    buf = bytearray(chunk)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            yield view[:n]


def hash_file(path: str | os.PathLike[str], part_size: int | None = None) -> FileDigest:
    """Read `path` once: its sha256 and, if `part_size` is given, its multipart composite checksum."""
    whole = hashlib.sha256()
    parts: list[bytes] = []
    size = 0
    step = part_size or CHUNK
    for view in iter_file(path, step):
        whole.update(view)
        if part_size:
            parts.append(hashlib.sha256(view).digest())
        size += len(view)
    digest = whole.digest()
    multipart = part_size is not None and size > part_size
    checksum = store_checksum(digest, parts, multipart) if part_size else base64.b64encode(digest).decode()
    return FileDigest(size=size, sha256=digest.hex(), checksum=checksum)
