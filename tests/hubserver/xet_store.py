"""The Xet CAS of the Hub test server: xorbs kept as opaque bytes on disk, files registered by shards, and the
short-lived CAS tokens the Hub hands out.

Test infrastructure only. A xorb is stored as uploaded and walked by its chunk headers once, for the byte
offset of each chunk (reconstruction answers give byte ranges of a xorb). A shard registers files: its file
info blocks give each file's Xet hash, sha256 and terms; the sha256 is what links a commit's `lfsFile` to
the Xet file. Every xorb a shard names must have been uploaded, with the chunks the shard says it has.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from tests.hubserver.xet_format import (
    SCHEME_NONE,
    FileInfo,
    Shard,
    Term,
    XetFormatError,
    chunk_offsets,
    decode_chunks,
)

MAX_XORB = 64 * 1024 * 1024  # the CAS refuses larger serialized xorbs


@dataclass(frozen=True)
class CasToken:
    """What a CAS access token allows: one repo, `read` or `write`, until `expires` (unix seconds)."""

    repo_id: str
    scope: str
    expires: int


class XetCas:
    """Xorbs, registered files and tokens. Thread-safe: the HTTP server is threaded."""

    def __init__(self, root: Path, *, token_ttl: int = 3600) -> None:
        self.xorb_dir = root
        self.xorb_dir.mkdir(parents=True, exist_ok=True)
        self.token_ttl = token_ttl
        self.lock = threading.Lock()
        self.offsets: dict[str, list[int]] = {}  # xorb hash -> chunk start offsets, plus the end
        self.files: dict[str, FileInfo] = {}  # Xet file hash -> its reconstruction
        self.tokens: dict[str, CasToken] = {}

    def issue(self, repo_id: str, scope: str) -> tuple[str, int]:
        token = "xet_" + secrets.token_urlsafe(24)
        expires = int(time.time()) + self.token_ttl
        with self.lock:
            self.tokens[token] = CasToken(repo_id, scope, expires)
        return token, expires

    def token(self, value: str) -> CasToken | None:
        with self.lock:
            held = self.tokens.get(value)
        return held if held is not None and held.expires > time.time() else None

    def xorb_path(self, xorb: str) -> Path:
        return self.xorb_dir / xorb

    def put_xorb(self, xorb: str, data: bytes) -> bool:
        """Store a serialized xorb under its hash; False if it was there already (not an error)."""
        if len(data) > MAX_XORB:
            raise XetFormatError(f"xorb of {len(data)} bytes is over the {MAX_XORB}-byte limit")
        offsets = chunk_offsets(data)
        if offsets[-1] != len(data) and data[offsets[-1] : offsets[-1] + 1] == b"\0":
            raise XetFormatError("xorb has bytes after its last chunk that are not a footer")
        with self.lock:
            if xorb in self.offsets:
                return False
        tmp = self.xorb_dir / f".{xorb}.{threading.get_ident()}"
        tmp.write_bytes(data)
        os.replace(tmp, self.xorb_path(xorb))
        with self.lock:
            self.offsets[xorb] = offsets
        return True

    def register(self, shard: Shard) -> list[FileInfo]:
        """Check a shard against the stored xorbs and register its files; returns them."""
        with self.lock:
            for x in shard.xorbs:
                offsets = self.offsets.get(x.xorb)
                if offsets is None:
                    raise XetFormatError(f"shard lists xorb {x.xorb}, which was never uploaded")
                if len(offsets) - 1 != len(x.chunks):
                    raise XetFormatError(
                        f"shard says xorb {x.xorb} has {len(x.chunks)} chunks; it has {len(offsets) - 1}"
                    )
            for f in shard.files:
                if f.sha256 is None:
                    raise XetFormatError(f"file {f.file_hash} has no sha256 (metadata extension)")
                for t in f.terms:
                    offsets = self.offsets.get(t.xorb)
                    if offsets is None:
                        raise XetFormatError(f"file {f.file_hash} uses xorb {t.xorb}, never uploaded")
                    if t.end > len(offsets) - 1:
                        raise XetFormatError(f"file {f.file_hash} uses chunks past the end of {t.xorb}")
            for f in shard.files:
                self.files[f.file_hash] = f
        return list(shard.files)

    def file(self, file_hash: str) -> FileInfo | None:
        with self.lock:
            return self.files.get(file_hash)

    def chunk_bytes(self, xorb: str, start: int, end: int) -> tuple[int, int]:
        """The byte range [first, last] (inclusive, as in a Range header) of chunks [start, end) of a xorb."""
        with self.lock:
            offsets = self.offsets[xorb]
        return offsets[start], offsets[end] - 1

    def materialize(self, info: FileInfo, dest: Path) -> None:
        """Write the file's bytes to `dest` from its xorbs, checking them against its sha256."""
        h, tmp = hashlib.sha256(), dest.with_name(f".{dest.name}.{threading.get_ident()}")
        with open(tmp, "wb") as out:
            for t in info.terms:
                data = self.read_term(t)
                h.update(data)
                out.write(data)
        if h.hexdigest() != info.sha256:
            tmp.unlink()
            got = h.hexdigest()
            raise XetFormatError(f"file {info.file_hash} rebuilds to sha256 {got}, not {info.sha256}")
        os.replace(tmp, dest)

    def tamper(self, info: FileInfo, at: int) -> None:
        """Flip byte `at` of the file where it is stored, behind the client's back. The chunk holding it is
        stored again uncompressed, so a reader gets the file with that one byte changed (not a chunk it
        cannot decode, which hf_xet would retry for minutes)."""
        for t in info.terms:
            if at >= t.size:
                at -= t.size
                continue
            with self.lock:
                offsets = self.offsets[t.xorb]
            path = self.xorb_path(t.xorb)
            data = path.read_bytes()
            for i in range(t.start, t.end):
                chunk = bytearray(decode_chunks(data, offsets, i, i + 1))
                if at >= len(chunk):
                    at -= len(chunk)
                    continue
                chunk[at] ^= 0xFF
                n = len(chunk).to_bytes(3, "little")
                header = b"\0" + n + bytes([SCHEME_NONE]) + n
                data = data[: offsets[i]] + header + chunk + data[offsets[i + 1] :]
                path.write_bytes(data)
                with self.lock:
                    self.offsets[t.xorb] = chunk_offsets(data)
                return
        raise ValueError("offset past the end of the file")

    def read_term(self, t: Term) -> bytes:
        with self.lock:
            offsets = self.offsets[t.xorb]
        with open(self.xorb_path(t.xorb), "rb") as f:
            f.seek(offsets[t.start])
            raw = f.read(offsets[t.end] - offsets[t.start])
        shifted = [o - offsets[t.start] for o in offsets[t.start : t.end + 1]]
        data = decode_chunks(raw, shifted, 0, t.end - t.start)
        if len(data) != t.size:
            raise XetFormatError(f"term of {t.xorb} decodes to {len(data)} bytes, the shard says {t.size}")
        return data


def merged_fetch_ranges(terms: list[Term]) -> dict[str, list[tuple[int, int]]]:
    """Per xorb, the chunk ranges to fetch: the terms' ranges sorted, with overlapping or adjacent ones
    merged, so each term lies inside exactly one fetch range."""
    by_xorb: dict[str, list[tuple[int, int]]] = {}
    for t in terms:
        by_xorb.setdefault(t.xorb, []).append((t.start, t.end))
    out: dict[str, list[tuple[int, int]]] = {}
    for xorb, ranges in by_xorb.items():
        merged: list[tuple[int, int]] = []
        for start, end in sorted(ranges):
            if merged and start <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], end))
            else:
                merged.append((start, end))
        out[xorb] = merged
    return out
