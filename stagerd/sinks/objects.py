"""What the fsspec sink and its backends share: the records of local files and remote objects, the
`Backend` protocol a store implements, and the helpers that need no store: scanning the local tree,
planning reuse, checking a listing against a manifest, deciding whether `latest` moves, and the manifest's
bytes.
"""

from __future__ import annotations

import builtins
import json
import logging
import threading
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

from stagerd.contract import layout
from stagerd.contract.export_tree import walk_entries
from stagerd.contract.manifest import ExportManifest, read_manifest
from stagerd.errors import MarkerError, SinkConflictError, SinkError, VerifyError
from stagerd.sinks.base import ProgressFn
from stagerd.sinks.url_text import SECRET_PARAMS

log = logging.getLogger("stagerd.sinks.fsspec")

CLOCK_NAME = ".stagerd-clock"  # the file:// store's clock probe (`local_dirs.Held.clock`), under a temp name


# ---------------------------------------------------------------------------------------------------------
# contracts


@dataclass(frozen=True)
class LocalFile:
    """One file to publish: its path relative to the step on the remote, its local path, its size."""

    rel: str
    path: Path
    size: int


@dataclass(frozen=True)
class RemoteObject:
    """One remote file: size, and the store's checksum (base64, `-N` when composite) if it has one."""

    size: int
    checksum: str | None = None


@dataclass(frozen=True)
class StoredObject:
    """One object as a store lists it for retention and claims: its size, its LastModified (the store's
    clock), and the tag a conditional write compares (S3's ETag; a file's inode, mtime and size)."""

    size: int
    mtime: float | None = None
    tag: str | None = None


@dataclass(frozen=True)
class Uploaded:
    """One file as uploaded: its sha256 hex (for the manifest) and the checksum the store should report.

    `confirmed`: the store's own answer about this object (its reply to the upload, or a HEAD) has already
    been checked against `checksum`, so verification needs only the listing for it.
    """

    rel: str
    size: int
    sha256: str
    checksum: str | None
    confirmed: bool = False
    etag: str | None = None  # the store's version of the object this publish wrote (S3), for `discard`


class ByteProgress:
    """Thread-safe byte counter that forwards to the caller's `ProgressFn`."""

    def __init__(self, total: int, fn: ProgressFn | None) -> None:
        self.total, self.done, self._fn, self._lock = total, 0, fn, threading.Lock()

    def __call__(self, n: int) -> None:
        with self._lock:
            self.done += n
            done = self.done
        if self._fn is not None:
            self._fn(done, self.total)


class Backend(Protocol):
    """What the publish algorithm needs from a store. Keys are relative to the sink's root."""

    has_checksums: bool

    def list(self, prefix: str) -> dict[str, RemoteObject]:
        """Every object under `prefix/`, keyed by its path relative to `prefix`, with checksums if cheap."""
        ...

    def checksums(self, prefix: str, rels: builtins.list[str]) -> dict[str, str | None]:
        """The store's checksum of each `prefix/rel` (None where it has none)."""
        ...

    def read(self, key: str, limit: int | None = None) -> bytes | None:
        """The bytes of `key` (at most `limit` of them), or None if it does not exist."""
        ...

    def write(self, key: str, data: bytes) -> None:
        """Create or replace `key`."""
        ...

    def create(self, key: str, data: bytes) -> bool:
        """Create `key` only if it does not exist; False if it already did."""
        ...

    def digest(self, f: LocalFile) -> Uploaded:
        """Read `f` once: its sha256 and the checksum this store would report for it."""
        ...

    def upload(
        self, prefix: str, files: builtins.list[LocalFile], progress: ByteProgress
    ) -> builtins.list[Uploaded]:
        """Upload `files` under `prefix/`, hashing while streaming."""
        ...

    def sweep(self, prefix: str, *, settled: bool = False) -> None:
        """Remove what a killed publisher left of `prefix/`: temp files, pending multipart uploads.
        `settled`: the step's manifest is there and none of its writers is left (the fleet's commit, once
        every owner recorded its files), so a file:// temp file there goes whoever's host wrote it."""
        ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class Latest:
    """`latest` as read: its bytes (None: absent) and the store's tag for writing it only if unchanged."""

    data: bytes | None
    etag: str | None = None


@dataclass(frozen=True)
class Claiming:
    """The claim a publish makes on its step's prefix (`claims.py`): its key, its bytes, and whether a
    claim read back is this publisher's own (a restart of it)."""

    key: str
    data: bytes
    owns: Callable[[bytes | None], bool]


@dataclass(frozen=True)
class StepOpening:
    """What opening a step learnt: the manifest's bytes (None if absent); from a batching store also the
    listing (None: not listed, because every file was created while opening), and the files it already
    created (`created`, confirmed) or found taken (`refused`: hashed, not sent; their keys held an object
    already); whether this publisher holds the step's claim, and the claim it found when it does not."""

    existing: bytes | None
    listed: dict[str, RemoteObject] | None
    created: list[Uploaded]
    refused: list[Uploaded]
    claimed: bool = True
    claim: bytes | None = None


@runtime_checkable
class LatestStore(Protocol):
    """A store that moves `latest` forward atomically: no other write of it between the read and the write
    (S3's conditional writes, a file:// lock). Other stores get read-then-write."""

    def move_latest(self, key: str, name: bytes, step: int) -> None:
        """Point `key` at `name` unless it names a newer step than `step`, judged on what it holds."""
        ...


@runtime_checkable
class BatchingStore(Protocol):
    """A store that sends a publish's independent requests together, one round trip instead of several,
    and can write without overwriting (so some uploads need not wait for the listing)."""

    def open_step(
        self,
        prefix: str,
        manifest_key: str,
        latest_key: str,
        files: builtins.list[LocalFile],
        progress: ByteProgress,
        claim: Claiming,
    ) -> StepOpening:
        """Together: the create of `claim`, `list(prefix)`, create-only uploads of the `files` the store
        chooses, and the read of `latest_key` unless the store knows its version; then the manifest's bytes
        if the listing shows one. A claim found taken is read back, and `sweep(prefix)` runs only when it
        is this publisher's own. Where every file could be created that way and the claim too, the listing
        is not needed: a taken key or manifest refuses the write."""
        ...

    def move_latest(self, key: str, name: bytes, step: int) -> None:
        """Point `key` at `name` unless it names a newer step than `step`, writing only over the version
        known (read while opening, or last written here); a `latest` that changed meanwhile is read and
        judged again."""
        ...

    def discard(self, keys: builtins.list[tuple[str, str | None]]) -> None:
        """Delete each (key, version) this publisher created, only while the key still holds that version;
        best effort."""
        ...


# ---------------------------------------------------------------------------------------------------------
# pure planning


def redact_url(url: str) -> str:
    """`url` without a password in its authority and without secret-looking query values. Never raises:
    it runs on the URLs it is asked to quote in errors, malformed ones included."""
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError:  # e.g. an unclosed `[` (an IPv6 host): the authority's end is unknown
        base, query, _ = url.partition("?")
        scheme, sep, rest = base.rpartition("://")
        if "@" in rest:
            rest = "***@" + rest.rsplit("@", 1)[1]
        return scheme + sep + rest + ("?***" if query else "")
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, host = netloc.rsplit("@", 1)
        netloc = f"{userinfo.split(':', 1)[0]}:***@{host}" if ":" in userinfo else f"***@{host}"
    query = parts.query
    if query:
        pairs = urllib.parse.parse_qsl(query, keep_blank_values=True)
        query = urllib.parse.urlencode(
            [(k, "***" if any(s in k.lower() for s in SECRET_PARAMS) else v) for k, v in pairs]
        )
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def scan_dir(root: Path, *, skip_dirs: frozenset[str] | set[str] = frozenset()) -> list[LocalFile]:
    """Every regular file under `root` (sorted, relative, `/`-separated), except a manifest at its top."""
    if not root.is_dir():
        raise VerifyError("is not a directory", path=root)
    out = []
    for rel, p in walk_entries(root, skip_top_dirs=skip_dirs):
        if rel == layout.MANIFEST_NAME or p.is_dir() or not p.is_file():
            continue
        layout.safe_relpath(rel, what="file", path=p)
        out.append(LocalFile(rel, p, p.stat().st_size))
    return out


def same_files(a: ExportManifest, b: ExportManifest) -> bool:
    """Two manifests describe the same bytes (names, sizes, sha256; not times or metadata)."""
    key = lambda m: sorted((f.path, f.size, f.sha256) for f in m.files)  # noqa: E731
    return key(a) == key(b)


def same_checksum(remote: str | None, expected: str | None) -> bool:
    """S3 checksums compare equal; a composite's `-N` suffix counts only when both sides carry one."""
    if not remote or not expected:
        return False
    if ("-" in remote) != ("-" in expected):
        return remote.split("-")[0] == expected.split("-")[0]
    return remote == expected


def plan_reuse(local: list[LocalFile], remote: Mapping[str, RemoteObject]) -> list[LocalFile]:
    """The local files that a checksum-capable store may already hold: same name and size, with a checksum."""
    return [f for f in local if (r := remote.get(f.rel)) is not None and r.size == f.size and r.checksum]


def verify_listing(
    manifest: ExportManifest, remote: Mapping[str, RemoteObject], checksums: Mapping[str, str | None]
) -> list[str]:
    """Problems between the manifest and the remote listing: missing files, wrong sizes, wrong checksums.

    `checksums` maps a file to the checksum the store should report for it; a store that reports none is
    checked by name and size only.
    """
    problems = []
    for f in manifest.files:
        r = remote.get(f.path)
        if r is None:
            problems.append(f"{f.path}: missing")
        elif r.size != f.size:
            problems.append(f"{f.path}: {r.size} bytes, expected {f.size}")
        elif r.checksum and checksums.get(f.path) and not same_checksum(r.checksum, checksums[f.path]):
            problems.append(f"{f.path}: checksum {r.checksum}, expected {checksums[f.path]}")
    return problems


MAX_LATEST_BYTES = 1024  # what is read of `latest`: a step name, or a sign that the object is not ours
# What is read of a claim, as of a manifest (`MAX_MANIFEST_BYTES`): anyone may put an object of any size
# at its key
MAX_CLAIM_BYTES = 128 << 10


def _latest_step(current: bytes) -> int | None:
    return layout.parse_step_dir(current[:MAX_LATEST_BYTES].decode(errors="replace").strip())


def newer_latest(current: bytes | None, step: int) -> bool:
    """True when `latest` should be moved to `step`: it is absent or names an older step. A `latest` that
    names no step is not stagerd's (its writes are atomic, so it never leaves a torn one): another tool's
    object at a shared root, never overwritten (`foreign_latest`)."""
    if current is None:
        return True
    cur = _latest_step(current)
    return cur is not None and cur <= step


def foreign_latest(current: bytes | None, where: str) -> None:
    """Warn when `latest` at `where` names no step: it is left as it is, and not moved."""
    if current is not None and _latest_step(current) is None:
        log.warning(
            "%s names no step (%d bytes or more): another tool's object, left as it is; latest is not moved",
            where,
            len(current),
            extra={"sink": where},
        )


def changed_error(f: LocalFile, size: int) -> SinkError:
    """The error for a local file whose size changed between the scan and its upload."""
    return SinkError(f"changed while publishing: read {size} bytes, expected {f.size}", path=f.path)


def manifest_bytes(manifest: ExportManifest) -> bytes:
    return (json.dumps(manifest.to_json(), indent=2) + "\n").encode()


def parse_manifest(data: bytes, where: str) -> ExportManifest:
    try:
        return read_manifest(data, where)
    except MarkerError as e:
        raise SinkConflictError(f"remote manifest {e.message}", path=where) from None
