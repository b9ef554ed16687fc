"""The fsspec sink: `s3://BUCKET/PREFIX`, `file:///PATH`, and any other fsspec URL.

Remote layout, per step:

    PREFIX/step-00000100/<export files>          large files as parallel multipart (S3)
    PREFIX/step-00000100/stagerd.manifest.json   written LAST, with If-None-Match: *; it is the commit
    PREFIX/latest                                 the name of the newest published step dir

A step without a manifest is absent to a reader. A re-run after a crash uploads only what is missing or
differs (judged by size and the store's sha256 checksum where it has one), never writes a second manifest
that differs from the first, and raises `SinkConflictError` if the remote manifest disagrees with the export.

Three backends share one publish algorithm: S3 (async, parallel multipart with per-part SHA256 checksums,
on s3fs's event loop), the local filesystem (fsync'd, exclusive manifest by `link`), and any other fsspec
filesystem (sequential, best effort `exists` then write for the manifest).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import threading
import time
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from stagerd import layout
from stagerd.crashpoints import crash_point
from stagerd.errors import ConfigError, MarkerError, SinkAuthError, SinkConflictError, SinkError, VerifyError
from stagerd.hashing import ALGORITHMS, ObjectHasher, b64, hash_file, iter_file, raw_checksum, read_full
from stagerd.layout import ExportManifest, ManifestFile
from stagerd.sinks.base import ProgressFn, PublishResult

log = logging.getLogger("stagerd.sinks.fsspec")

LATEST_NAME = "latest"
RAW_DIR = "raw"
_SECRET_PARAMS = ("token", "secret", "key", "password", "signature", "credential", "sig", "auth")
_SKIP_DIRS = {layout.EXPORT_DIR, layout.EXPORT_TMP_DIR}
# `.NAME.tmp-PID[-TID]`: LocalBackend's and layout.write_bytes_atomic's temp names
_TEMP_NAME = re.compile(r"\..+\.tmp-(\d+)(?:-\d+)?")


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
    """One remote file: size, and the store's checksum (base64 sha256, `-N` when composite) if it has one."""

    size: int
    checksum: str | None = None


@dataclass(frozen=True)
class Uploaded:
    """One file as uploaded: its sha256 hex (for the manifest) and the checksum the store should report."""

    rel: str
    size: int
    sha256: str
    checksum: str | None


class _Progress:
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

    def checksums(self, prefix: str, rels: list[str]) -> dict[str, str | None]:
        """The store's checksum of each `prefix/rel` (None where it has none)."""
        ...

    def read(self, key: str) -> bytes | None:
        """The bytes of `key`, or None if it does not exist."""
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

    def upload(self, prefix: str, files: list[LocalFile], progress: _Progress) -> list[Uploaded]:
        """Upload `files` under `prefix/`, hashing while streaming."""
        ...

    def sweep(self, prefix: str) -> None:
        """Remove what a killed publisher left of `prefix/`: temp files, pending multipart uploads."""
        ...

    def close(self) -> None: ...


# ---------------------------------------------------------------------------------------------------------
# pure planning


def redact_url(url: str) -> str:
    """`url` without a password in its authority and without secret-looking query values."""
    parts = urllib.parse.urlsplit(url)
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, host = netloc.rsplit("@", 1)
        netloc = f"{userinfo.split(':', 1)[0]}:***@{host}" if ":" in userinfo else f"***@{host}"
    query = parts.query
    if query:
        pairs = urllib.parse.parse_qsl(query, keep_blank_values=True)
        query = urllib.parse.urlencode(
            [(k, "***" if any(s in k.lower() for s in _SECRET_PARAMS) else v) for k, v in pairs]
        )
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def scan_dir(root: Path, *, skip_dirs: frozenset[str] | set[str] = frozenset()) -> list[LocalFile]:
    """Every regular file under `root` (sorted, relative, `/`-separated), except a manifest at its top."""
    if not root.is_dir():
        raise VerifyError("is not a directory", path=root)
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        if here == root:
            dirnames[:] = [d for d in dirnames if d not in skip_dirs]
        for name in filenames:
            p = here / name
            rel = p.relative_to(root).as_posix()
            if rel == layout.MANIFEST_NAME or not p.is_file():
                continue
            layout.safe_relpath(rel, what="file", path=p)
            out.append(LocalFile(rel, p, p.stat().st_size))
    return sorted(out, key=lambda f: f.rel)


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


def newer_latest(current: bytes | None, step: int) -> bool:
    """True when `latest` should be moved to `step`: it is absent, unreadable, or names an older step."""
    if current is None:
        return True
    cur = layout.parse_step_dir(current.decode(errors="replace").strip())
    return cur is None or cur <= step


def _changed(f: LocalFile, size: int) -> SinkError:
    return SinkError(f"changed while publishing: read {size} bytes, expected {f.size}", path=f.path)


def manifest_bytes(manifest: ExportManifest) -> bytes:
    return (json.dumps(manifest.to_json(), indent=2) + "\n").encode()


def parse_manifest(data: bytes, where: str) -> ExportManifest:
    try:
        return ExportManifest.from_json(json.loads(data), path=where)
    except (ValueError, UnicodeDecodeError, AttributeError) as e:
        raise SinkConflictError(f"remote manifest is not valid JSON ({e})", path=where) from None
    except MarkerError as e:
        raise SinkConflictError(f"remote manifest is malformed: {e.message}", path=where) from None


# ---------------------------------------------------------------------------------------------------------
# the sink


class FsspecSink:
    """Publishes steps to `PREFIX/step-XXXXXXXX/` on any fsspec store, the manifest last."""

    def __init__(self, url: str, backend: Backend) -> None:
        self.url = redact_url(url.rstrip("/"))
        self._backend = backend

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        storage_options: Mapping[str, Any] | None = None,
        part_size: int = 16 << 20,
        max_concurrency: int = 8,
        checksum: str = "CRC32",
        **options: Any,
    ) -> FsspecSink:
        """Open the store behind `url`. `storage_options` go to the fsspec filesystem (s3fs: `key`,
        `secret`, `endpoint_url`, `profile`, `client_kwargs`, `config_kwargs`...); the AWS environment
        and config files apply to S3 as usual. S3 only: `part_size` and `max_concurrency` (parts in
        flight, so memory is about their product), `checksum` (CRC32 or SHA256) the store verifies."""
        import fsspec

        opts = {**dict(storage_options or {}), **options}
        protocol, path = fsspec.core.split_protocol(url)
        try:
            if protocol in (None, "file", "local"):
                backend: Backend = LocalBackend(Path(path or "/"))
            elif protocol in ("s3", "s3a"):
                backend = S3Backend.open(
                    url, opts, part_size=part_size, max_concurrency=max_concurrency, checksum=checksum
                )
            else:
                fs, root = fsspec.core.url_to_fs(url, **opts)
                backend = FsspecBackend(fs, root)
        except (ValueError, ImportError, TypeError) as e:
            raise ConfigError(
                f"cannot open sink {redact_url(url)}: {type(e).__name__}: {e}",
                hint="use s3://BUCKET/PREFIX, file:///PATH, hf://ORG/REPO or an fsspec URL whose "
                "package is installed (gcsfs for gs://, adlfs for az://)",
            ) from None
        except OSError as e:  # stores that connect on open (ftp, sftp) and are down: retry later
            why = e.strerror or "connection failed"
            raise SinkError(f"cannot reach sink {redact_url(url)}: {type(e).__name__}: {why}") from None
        return cls(url, backend)

    # -- Sink protocol -----------------------------------------------------------------------------------

    def publish(
        self,
        export_dir: Path,
        step: int,
        *,
        metadata: Mapping[str, Any] | None = None,
        progress: ProgressFn | None = None,
    ) -> PublishResult:
        """Upload `export_dir` as `step`, verify it, commit its manifest, move `latest`."""
        export_dir = Path(export_dir)
        files = scan_dir(export_dir)
        return self._publish_tree(files, layout.step_dir_name(step), step, metadata, progress, export_dir)

    def publish_raw(self, step_dir: Path, step: int, *, progress: ProgressFn | None = None) -> PublishResult:
        """Publish the raw staged step (DCP shards, `optim/`, extras, commit marker) under
        `PREFIX/raw/step-XXXXXXXX/` for resume, separately from the HF export."""
        step_dir = Path(step_dir)
        if not layout.is_committed(step_dir):
            raise VerifyError("has no commit marker: only committed steps are published raw", path=step_dir)
        marker = layout.read_marker(step_dir)
        layout.check_staged_files(step_dir, marker)
        files = scan_dir(step_dir, skip_dirs=_SKIP_DIRS)
        prefix = f"{RAW_DIR}/{layout.step_dir_name(step)}"
        nodes = getattr(marker, "staging_nodes", 1)
        if nodes > 1:  # each staging node holds only its own shards: one raw tree per node
            prefix = f"{prefix}/node-{marker.staging_node:05d}-of-{nodes:05d}"
        return self._publish_tree(files, prefix, step, {"raw": True}, progress, step_dir)

    def is_published(self, step: int) -> bool:
        """True when the step's manifest exists and the listing matches it by name and size."""
        prefix = layout.step_dir_name(step)
        data = self._call(lambda: self._backend.read(f"{prefix}/{layout.MANIFEST_NAME}"), prefix)
        if data is None:
            return False
        manifest = parse_manifest(data, self._where(prefix, layout.MANIFEST_NAME))
        remote = self._call(lambda: self._backend.list(prefix), prefix)
        return manifest.step == step and not verify_listing(manifest, remote, {})

    def close(self) -> None:
        self._backend.close()

    # -- the algorithm -----------------------------------------------------------------------------------

    def _publish_tree(
        self,
        files: list[LocalFile],
        prefix: str,
        step: int,
        metadata: Mapping[str, Any] | None,
        progress: ProgressFn | None,
        local_root: Path,
    ) -> PublishResult:
        t0 = time.monotonic()
        if not files:
            raise VerifyError("has no files to publish", path=local_root)
        b = self._backend
        manifest_key = f"{prefix}/{layout.MANIFEST_NAME}"
        total = sum(f.size for f in files)
        prog = _Progress(total, progress)

        existing = self._call(lambda: b.read(manifest_key), manifest_key)
        self._call(lambda: b.sweep(prefix), prefix)  # after a first call that fails fast on bad credentials
        if existing is not None:
            remote_manifest = parse_manifest(existing, self._where(manifest_key))
            digests = [b.digest(f) for f in files]
            self._check_same(remote_manifest, self._manifest(step, digests, metadata), manifest_key)
            self._verify(prefix, remote_manifest, {d.rel: d.checksum for d in digests})
            self._move_latest(prefix, step)
            log.info("step %d already on %s", step, self.url, extra={"step": step, "sink": self.url})
            return self._result(prefix, step, files, 0, True, t0)

        remote = self._call(lambda: b.list(prefix), prefix)
        reused: dict[str, Uploaded] = {}
        same_size = [f.rel for f in files if f.rel in remote and remote[f.rel].size == f.size]
        if b.has_checksums and same_size:
            have = self._call(lambda: b.checksums(prefix, same_size), prefix)
            remote = {k: RemoteObject(v.size, have.get(k, v.checksum)) for k, v in remote.items()}
            for f in plan_reuse(files, remote):
                d = b.digest(f)
                if same_checksum(remote[f.rel].checksum, d.checksum):
                    reused[f.rel] = d
                    prog(f.size)
        todo = [f for f in files if f.rel not in reused]
        uploaded = self._call(lambda: b.upload(prefix, todo, prog), prefix) if todo else []
        digests = sorted([*reused.values(), *uploaded], key=lambda d: d.rel)
        manifest = self._manifest(step, digests, metadata)
        self._verify(prefix, manifest, {d.rel: d.checksum for d in digests})

        if not self._call(lambda: b.create(manifest_key, manifest_bytes(manifest)), manifest_key):
            # another publisher committed this step between our check and our write
            raw = self._call(lambda: b.read(manifest_key), manifest_key) or b""
            other = parse_manifest(raw, self._where(manifest_key))
            self._check_same(other, manifest, manifest_key)
        crash_point("fsspec.manifest")
        self._move_latest(prefix, step)
        sent = sum(f.size for f in todo)
        log.info(
            "published step %d to %s: %d files, %d bytes uploaded, %d reused",
            step,
            self.url,
            len(files),
            sent,
            len(reused),
            extra={"step": step, "sink": self.url},
        )
        return self._result(prefix, step, files, sent, False, t0)

    def _manifest(
        self, step: int, digests: list[Uploaded], metadata: Mapping[str, Any] | None
    ) -> ExportManifest:
        return ExportManifest(
            step=step,
            files=tuple(ManifestFile(d.rel, d.size, d.sha256) for d in sorted(digests, key=lambda d: d.rel)),
            metadata=dict(metadata or {}),
        )

    def _check_same(self, remote: ExportManifest, local: ExportManifest, key: str) -> None:
        if remote.step != local.step or not same_files(remote, local):
            raise SinkConflictError(
                f"the remote manifest for step {remote.step} lists different files or hashes than the "
                f"local export for step {local.step}",
                path=self._where(key),
            )

    def _verify(self, prefix: str, manifest: ExportManifest, expected: Mapping[str, str | None]) -> None:
        b = self._backend
        remote = self._call(lambda: b.list(prefix), prefix)
        if b.has_checksums:
            have = self._call(lambda: b.checksums(prefix, [f.path for f in manifest.files]), prefix)
            remote = {k: RemoteObject(v.size, have.get(k, v.checksum)) for k, v in remote.items()}
        problems = verify_listing(manifest, remote, expected)
        if problems:
            raise SinkError(
                f"verification failed after upload: {'; '.join(problems[:5])}"
                + (f" (+{len(problems) - 5} more)" if len(problems) > 5 else ""),
                path=self._where(prefix),
            )

    def _move_latest(self, prefix: str, step: int) -> None:
        key = f"{RAW_DIR}/{LATEST_NAME}" if prefix.startswith(f"{RAW_DIR}/") else LATEST_NAME
        b = self._backend
        current = self._call(lambda: b.read(key), key)
        name = layout.step_dir_name(step)
        if newer_latest(current, step) and current != name.encode():
            self._call(lambda: b.write(key, name.encode()), key)

    def _result(
        self, prefix: str, step: int, files: list[LocalFile], sent: int, skipped: bool, t0: float
    ) -> PublishResult:
        return PublishResult(
            sink=self.url,
            step=step,
            location=self._where(prefix),
            files=len(files),
            bytes_total=sum(f.size for f in files),
            bytes_uploaded=sent,
            skipped=skipped,
            seconds=time.monotonic() - t0,
        )

    def _where(self, *parts: str) -> str:
        return "/".join([self.url, *parts])

    def _call(self, fn: Callable[[], Any], key: str) -> Any:
        """Run one backend operation; turn OS-level failures into named sink errors naming the file."""
        try:
            return fn()
        except SinkError:
            raise
        except PermissionError as e:
            raise SinkAuthError(f"permission denied: {e.strerror or e}", path=self._where(key)) from None
        except OSError as e:
            raise SinkError(f"{type(e).__name__}: {e.strerror or e}", path=self._where(key)) from None


# ---------------------------------------------------------------------------------------------------------
# local filesystem


class LocalBackend:
    """`file:///PATH`: fsync'd writes, each file renamed into place, the manifest created by `link`."""

    has_checksums = False

    def __init__(self, root: Path) -> None:
        self.root = root

    def list(self, prefix: str) -> dict[str, RemoteObject]:
        base = self.root / prefix
        out = {}
        for dirpath, _dirs, names in os.walk(base):
            for name in names:
                if name.startswith("."):
                    continue  # our own temp files
                p = Path(dirpath) / name
                out[p.relative_to(base).as_posix()] = RemoteObject(p.stat().st_size)
        return out

    def checksums(self, prefix: str, rels: list[str]) -> dict[str, str | None]:
        return dict.fromkeys(rels)

    def sweep(self, prefix: str) -> None:
        """Unlink temp files whose writer is dead: under `prefix/`, and next to `latest`."""
        base = self.root / prefix
        found = [Path(d) / n for d, _, names in os.walk(base) for n in names]
        for top in {self.root, base.parent}:
            found += [top / n for n in (os.listdir(top) if top.is_dir() else [])]
        for p in found:
            m = _TEMP_NAME.fullmatch(p.name)
            if m and not _alive(int(m.group(1))):
                p.unlink(missing_ok=True)

    def read(self, key: str) -> bytes | None:
        try:
            return (self.root / key).read_bytes()
        except FileNotFoundError:
            return None

    def write(self, key: str, data: bytes) -> None:
        path = self.root / key
        path.parent.mkdir(parents=True, exist_ok=True)
        layout.write_bytes_atomic(path, data)

    def create(self, key: str, data: bytes) -> bool:
        path = self.root / key
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
        self._write_fsync(tmp, [memoryview(data)])
        try:
            os.link(tmp, path)
            layout.fsync_dir(path.parent)
            return True
        except FileExistsError:
            return False
        finally:
            tmp.unlink(missing_ok=True)

    def digest(self, f: LocalFile) -> Uploaded:
        d = hash_file(f.path)
        return Uploaded(f.rel, d.size, d.sha256, None)

    def upload(self, prefix: str, files: list[LocalFile], progress: _Progress) -> list[Uploaded]:
        import hashlib

        out = []
        dirs = set()
        for f in files:
            dst = self.root / prefix / f.rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            tmp = dst.with_name(f".{dst.name}.tmp-{os.getpid()}-{threading.get_ident()}")
            h = hashlib.sha256()

            def chunks(f: LocalFile = f, h: Any = h) -> Any:
                for view in iter_file(f.path):
                    h.update(view)
                    progress(len(view))
                    yield view

            size = self._write_fsync(tmp, chunks())
            if size != f.size:
                tmp.unlink(missing_ok=True)
                raise _changed(f, size)
            crash_point("file.upload")
            os.replace(tmp, dst)
            dirs.add(dst.parent)
            out.append(Uploaded(f.rel, size, h.hexdigest(), None))
        for d in sorted(dirs):
            layout.fsync_dir(d)
        return out

    @staticmethod
    def _write_fsync(path: Path, chunks: Any) -> int:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        size = 0
        try:
            for view in chunks:
                while view:
                    n = os.write(fd, view)
                    size += n
                    view = view[n:]
            os.fsync(fd)
        finally:
            os.close(fd)
        return size

    def close(self) -> None:
        pass


# ---------------------------------------------------------------------------------------------------------
# any other fsspec filesystem


class FsspecBackend:
    """Any fsspec filesystem (gs://, az://, memory://...): sequential streamed writes, sizes-only verify.

    The manifest is created with an `exists` check then a write: such stores offer no portable
    create-if-absent, so two publishers racing on one step could both write it (stagerd runs one per node).
    """

    has_checksums = False

    def __init__(self, fs: Any, root: str) -> None:
        self.fs, self.root = fs, root.rstrip("/")

    def _path(self, key: str) -> str:
        return f"{self.root}/{key}"

    def list(self, prefix: str) -> dict[str, RemoteObject]:
        base = self._path(prefix)
        try:
            found = self.fs.find(base, detail=True)
        except FileNotFoundError:
            return {}
        out = {}
        for name, info in found.items():
            rel = self.fs._strip_protocol(name)[len(self.fs._strip_protocol(base)) :].lstrip("/")
            if rel and info.get("type", "file") == "file":
                out[rel] = RemoteObject(int(info["size"]))
        return out

    def checksums(self, prefix: str, rels: list[str]) -> dict[str, str | None]:
        return dict.fromkeys(rels)

    def sweep(self, prefix: str) -> None:
        """Nothing: writes through fsspec leave no temp names of ours."""

    def read(self, key: str) -> bytes | None:
        try:
            return self.fs.cat_file(self._path(key))
        except FileNotFoundError:
            return None

    def write(self, key: str, data: bytes) -> None:
        self.fs.pipe_file(self._path(key), data)

    def create(self, key: str, data: bytes) -> bool:
        if self.fs.exists(self._path(key)):
            return False
        self.fs.pipe_file(self._path(key), data)
        return True

    def digest(self, f: LocalFile) -> Uploaded:
        d = hash_file(f.path)
        return Uploaded(f.rel, d.size, d.sha256, None)

    def upload(self, prefix: str, files: list[LocalFile], progress: _Progress) -> list[Uploaded]:
        import hashlib

        out = []
        for f in files:
            h = hashlib.sha256()
            size = 0
            path = self._path(f"{prefix}/{f.rel}")
            self.fs.makedirs(self.fs._parent(path), exist_ok=True)
            with self.fs.open(path, "wb") as dst:
                for view in iter_file(f.path):
                    h.update(view)
                    dst.write(bytes(view))
                    size += len(view)
                    progress(len(view))
            if size != f.size:
                raise _changed(f, size)
            out.append(Uploaded(f.rel, size, h.hexdigest(), None))
        return out

    def close(self) -> None:
        pass


# ---------------------------------------------------------------------------------------------------------
# S3 (s3fs's session and event loop, the aiobotocore client called directly)

MIN_PART = 5 << 20
MAX_PARTS = 10_000
_AUTH_CODES = {
    "AccessDenied",
    "AccountProblem",
    "AllAccessDisabled",
    "ExpiredToken",
    "InvalidAccessKeyId",
    "InvalidSecurity",
    "InvalidToken",
    "SignatureDoesNotMatch",
    "TokenRefreshRequired",
}


def part_size_for(size: int, part_size: int) -> int:
    """`part_size`, or more (in MiB steps) where a file of `size` bytes would need over 10,000 parts."""
    need = -(-size // MAX_PARTS)
    if need <= part_size:
        return part_size
    mib = 1 << 20
    return -(-need // mib) * mib


def s3_error(e: BaseException, where: str) -> SinkError:
    """A botocore/aiohttp failure as a named sink error: auth problems are not retryable, the rest are.

    Only the S3 error code and message go into the text: never a header, a signature or a credential.
    """
    from botocore.exceptions import (
        ClientError,
        CredentialRetrievalError,
        NoCredentialsError,
        PartialCredentialsError,
    )

    if isinstance(e, SinkError):
        return e
    if isinstance(e, ClientError):
        err = e.response.get("Error", {})
        code = str(err.get("Code", "Unknown"))
        status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        msg = f"{code} (HTTP {status}) from {e.operation_name}: {err.get('Message', '')}".rstrip(": ")
        if code in _AUTH_CODES or status == 403:
            return SinkAuthError(msg, path=where)
        if code == "NoSuchBucket":
            return SinkError(msg, path=where, hint="create the bucket, or fix the sink URL")
        return SinkError(f"{msg} (after the client's retries)", path=where)
    if isinstance(e, NoCredentialsError | PartialCredentialsError | CredentialRetrievalError):
        return SinkAuthError(f"{type(e).__name__}: {e}", path=where)
    return SinkError(f"{type(e).__name__}: {e} (after the client's retries)", path=where)


class S3Backend:
    """S3 and compatible stores (MinIO, Ceph, R2) through s3fs's session, honouring the AWS environment.

    Every object is uploaded with a SHA256 checksum the store verifies on receipt and reports back: the
    plain sha256 for a single PUT, the composite of per-part sha256s for multipart. Retries are botocore's
    (bounded exponential backoff for 5xx, throttling, 429 and dropped connections; tune with
    AWS_RETRY_MODE / AWS_MAX_ATTEMPTS or `config_kwargs`); nothing here retries on top of them.
    """

    has_checksums = True

    def __init__(
        self, fs: Any, bucket: str, root: str, part_size: int, max_concurrency: int, checksum: str = "CRC32"
    ) -> None:
        if checksum not in ALGORITHMS:
            raise ConfigError(f"checksum {checksum!r} is not one of {', '.join(ALGORITHMS)}")
        self.algorithm = checksum
        if part_size < MIN_PART:
            raise ConfigError(f"part_size {part_size} is below S3's minimum of {MIN_PART} bytes")
        self.fs, self.bucket, self.root = fs, bucket, root.strip("/")
        self.part_size, self.max_concurrency = part_size, max(1, max_concurrency)
        self.base = f"s3://{bucket}/{self.root}" if self.root else f"s3://{bucket}"

    @classmethod
    def open(
        cls, url: str, opts: Mapping[str, Any], *, part_size: int, max_concurrency: int, checksum: str
    ) -> S3Backend:
        import s3fs

        parts = urllib.parse.urlsplit(url)
        if "@" in parts.netloc or parts.query:
            # s3fs would take them for part of the bucket or key, and every message would repeat them
            raise ConfigError(
                f"{redact_url(url)}: an S3 sink URL carries no credentials or query",
                hint="give S3 credentials by AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, a profile, or a role",
            )
        opts = dict(opts)
        config = {"max_pool_connections": max(10, 2 * max_concurrency), **dict(opts.pop("config_kwargs", {}))}
        # our own instance: settings here must not leak into other users of s3fs's instance cache
        fs = s3fs.S3FileSystem(skip_instance_cache=True, config_kwargs=config, **opts)
        bucket, _, root = fs._strip_protocol(url).partition("/")
        if not bucket:
            raise ConfigError(f"{redact_url(url)}: an S3 sink URL needs a bucket: s3://BUCKET/PREFIX")
        return cls(fs, bucket, root, part_size, max_concurrency, checksum)

    def _key(self, key: str) -> str:
        return f"{self.root}/{key}" if self.root else key

    def _where(self, key: str) -> str:
        return f"{self.base}/{key}"

    def _run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        from fsspec.asyn import sync

        return sync(self.fs.loop, fn, *args, **kwargs)

    async def _client(self) -> Any:
        return await self.fs.set_session()

    async def _call(self, where: str, method: str, **kwargs: Any) -> Any:
        s3 = await self._client()
        try:
            return await getattr(s3, method)(Bucket=self.bucket, **kwargs)
        except Exception as e:
            raise s3_error(e, where) from None

    # -- small operations ----------------------------------------------------------------------------------

    def list(self, prefix: str) -> dict[str, RemoteObject]:
        async def go() -> dict[str, RemoteObject]:
            s3 = await self._client()
            base = self._key(prefix) + "/"
            out: dict[str, RemoteObject] = {}
            try:
                async for page in s3.get_paginator("list_objects_v2").paginate(
                    Bucket=self.bucket, Prefix=base
                ):
                    for o in page.get("Contents", []):
                        out[o["Key"][len(base) :]] = RemoteObject(int(o["Size"]))
            except Exception as e:
                raise s3_error(e, self._where(prefix)) from None
            return out

        return self._run(go)

    def checksums(self, prefix: str, rels: list[str]) -> dict[str, str | None]:
        async def one(rel: str, sem: asyncio.Semaphore) -> tuple[str, str | None]:
            key = f"{prefix}/{rel}"
            async with sem:
                r = await self._call(
                    self._where(key), "head_object", Key=self._key(key), ChecksumMode="ENABLED"
                )
            return rel, r.get(f"Checksum{self.algorithm}")

        async def go() -> dict[str, str | None]:
            sem = asyncio.Semaphore(self.max_concurrency)
            return dict(await asyncio.gather(*(one(r, sem) for r in rels)))

        return self._run(go)

    def sweep(self, prefix: str) -> None:
        """Abort multipart uploads pending under `prefix/` (one publisher owns a step, and it is here).
        Best effort: credentials without s3:ListBucketMultipartUploads leave them to a lifecycle rule."""

        async def go() -> None:
            s3 = await self._client()
            base = self._key(prefix) + "/"
            try:
                pages = s3.get_paginator("list_multipart_uploads").paginate(Bucket=self.bucket, Prefix=base)
                async for page in pages:
                    for u in page.get("Uploads", []):
                        await s3.abort_multipart_upload(
                            Bucket=self.bucket, Key=u["Key"], UploadId=u["UploadId"]
                        )
            except Exception as e:
                log.warning(
                    "cannot abort stale multipart uploads under %s: %s", self._where(prefix), s3_error(e, "")
                )

        self._run(go)

    def read(self, key: str) -> bytes | None:
        async def go() -> bytes | None:
            s3 = await self._client()
            try:
                r = await s3.get_object(Bucket=self.bucket, Key=self._key(key))
                async with r["Body"] as body:
                    return await body.read()
            except s3.exceptions.NoSuchKey:
                return None
            except Exception as e:
                raise s3_error(e, self._where(key)) from None

        return self._run(go)

    def write(self, key: str, data: bytes) -> None:
        self._run(self._call, self._where(key), "put_object", **self._put_args(key, data))

    def create(self, key: str, data: bytes) -> bool:
        """`PutObject` with `If-None-Match: *`; a store that does not implement it gets exists-then-put."""
        from botocore.exceptions import ClientError

        async def go() -> bool:
            s3 = await self._client()
            args = self._put_args(key, data)
            try:
                await s3.put_object(Bucket=self.bucket, IfNoneMatch="*", **args)
                return True
            except ClientError as e:
                code = e.response.get("Error", {}).get("Code")
                status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
                if status == 412 or code in ("PreconditionFailed", "ConditionalRequestConflict"):
                    return False
                if status != 501 and code != "NotImplemented":
                    raise s3_error(e, self._where(key)) from None
            except Exception as e:
                raise s3_error(e, self._where(key)) from None
            log.warning("%s does not support conditional writes; using exists-then-put", self.base)
            if await self._exists(key):
                return False
            await self._call(self._where(key), "put_object", **args)
            return True

        return self._run(go)

    async def _exists(self, key: str) -> bool:
        s3 = await self._client()
        try:
            await s3.head_object(Bucket=self.bucket, Key=self._key(key))
            return True
        except Exception as e:
            err = getattr(e, "response", {}).get("Error", {})
            if err.get("Code") in ("404", "NoSuchKey", "NotFound"):
                return False
            raise s3_error(e, self._where(key)) from None

    def _put_args(self, key: str, data: bytes, checksum: str | None = None) -> dict[str, Any]:
        if checksum is None:
            checksum = b64(raw_checksum(data, self.algorithm))
        return {"Key": self._key(key), "Body": data, **self._checksum_args(checksum)}

    def _checksum_args(self, checksum: str) -> dict[str, str]:
        # the algorithm header makes stores (and moto) keep the checksum and report it back
        return {"ChecksumAlgorithm": self.algorithm, f"Checksum{self.algorithm}": checksum}

    def digest(self, f: LocalFile) -> Uploaded:
        d = hash_file(f.path, part_size_for(f.size, self.part_size), self.algorithm)
        return Uploaded(f.rel, d.size, d.sha256, d.checksum)

    def close(self) -> None:
        import s3fs

        if getattr(self.fs, "_s3", None) is not None:
            s3fs.S3FileSystem.close_session(self.fs.loop, self.fs._s3)
            self.fs._s3 = None

    # -- uploads ---------------------------------------------------------------------------------------------

    def upload(self, prefix: str, files: list[LocalFile], progress: _Progress) -> list[Uploaded]:
        """Upload every file, up to `max_concurrency` requests (and as many parts in memory) at a time."""

        async def go() -> list[Uploaded]:
            parts = asyncio.Semaphore(self.max_concurrency)
            opened = asyncio.Semaphore(max(2, self.max_concurrency // 2))

            async def one(f: LocalFile) -> Uploaded:
                async with opened:
                    return await self._upload_one(f"{prefix}/{f.rel}", f, parts, progress)

            tasks = [asyncio.ensure_future(one(f)) for f in files]
            try:
                return list(await asyncio.gather(*tasks))
            except BaseException:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                raise

        return self._run(go)

    async def _upload_one(
        self, key: str, f: LocalFile, parts: asyncio.Semaphore, progress: _Progress
    ) -> Uploaded:
        where = self._where(key)
        part_size = part_size_for(f.size, self.part_size)
        if f.size <= part_size:
            async with parts:
                data, h = await asyncio.to_thread(_read_small, f, self.algorithm)
                checksum = h.object_checksum(multipart=False)
                await self._call(where, "put_object", **self._put_args(key, data, checksum))
            progress(len(data))
            return Uploaded(f.rel, len(data), h.sha256.hexdigest(), checksum)

        mpu = await self._call(
            where, "create_multipart_upload", Key=self._key(key), ChecksumAlgorithm=self.algorithm
        )
        upload_id = mpu["UploadId"]
        hasher = ObjectHasher(self.algorithm)
        tasks: list[asyncio.Future[dict[str, Any]]] = []
        failed = asyncio.Event()
        try:
            with open(f.path, "rb", buffering=0) as fh:
                number = 0
                while not failed.is_set():
                    await parts.acquire()
                    try:
                        data, raw = await asyncio.to_thread(_read_part, fh, part_size, hasher)
                    except BaseException:
                        parts.release()
                        raise
                    if not data:
                        parts.release()
                        break
                    number += 1
                    part = self._part(where, key, upload_id, number, data, b64(raw), parts, progress, failed)
                    tasks.append(asyncio.ensure_future(part))
            done = list(await asyncio.gather(*tasks))
            if hasher.size != f.size:
                raise _changed(f, hasher.size)
            await self._call(
                where,
                "complete_multipart_upload",
                Key=self._key(key),
                UploadId=upload_id,
                MultipartUpload={"Parts": done},
            )
        except BaseException:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self._abort(key, upload_id)
            raise
        return Uploaded(f.rel, hasher.size, hasher.sha256.hexdigest(), hasher.object_checksum(multipart=True))

    async def _part(
        self,
        where: str,
        key: str,
        upload_id: str,
        number: int,
        data: bytes,
        checksum: str,
        parts: asyncio.Semaphore,
        progress: _Progress,
        failed: asyncio.Event,
    ) -> dict[str, Any]:
        try:
            r = await self._call(
                f"{where} (part {number})",
                "upload_part",
                Key=self._key(key),
                UploadId=upload_id,
                PartNumber=number,
                Body=data,
                **self._checksum_args(checksum),
            )
            progress(len(data))
            crash_point("s3.part")
            return {"PartNumber": number, "ETag": r["ETag"], f"Checksum{self.algorithm}": checksum}
        except BaseException:
            failed.set()
            raise
        finally:
            parts.release()

    async def _abort(self, key: str, upload_id: str) -> None:
        """Best effort: a store that is down keeps the parts until a lifecycle rule reaps them."""
        try:
            s3 = await self._client()
            await asyncio.wait_for(
                s3.abort_multipart_upload(Bucket=self.bucket, Key=self._key(key), UploadId=upload_id), 30
            )
        except Exception as e:
            log.warning("could not abort the multipart upload of %s: %s", self._where(key), type(e).__name__)


def _read_small(f: LocalFile, algorithm: str) -> tuple[bytes, ObjectHasher]:
    data = f.path.read_bytes()
    if len(data) != f.size:
        raise _changed(f, len(data))
    h = ObjectHasher(algorithm)
    h.update(data)
    return data, h


def _read_part(fh: Any, part_size: int, hasher: ObjectHasher) -> tuple[bytes, bytes]:
    """The next part of an open file and its raw checksum, fed to the file's hashes on the way (so the
    file is read once); empty at the end."""
    data = read_full(fh, part_size)
    if not data:
        return b"", b""
    raw = hasher.update(data, part=True)
    assert raw is not None
    return data, raw


def _alive(pid: int) -> bool:
    """Whether `pid` is a live process on this host (ours counts as alive)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
