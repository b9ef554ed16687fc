"""The S3 backend: s3fs's session and event loop, the aiobotocore client called directly.

Files of two parts or more go up as parallel multipart uploads, each part with a checksum the store
verifies (the schedule is in `s3/upload.py`); the manifest is created with `If-None-Match: *`.
"""

from __future__ import annotations

import asyncio
import builtins
import logging
import os
import urllib.parse
from collections.abc import Callable, Mapping
from typing import Any

from stagerd.errors import ConfigError, SinkMissingError
from stagerd.sinks.hashing import ALGORITHMS, b64, hash_file, raw_checksum
from stagerd.sinks.listed import skipped, under
from stagerd.sinks.objects import (
    ByteProgress,
    Latest,
    LocalFile,
    RemoteObject,
    Uploaded,
    redact_url,
)
from stagerd.sinks.s3.client import (
    build_lazy_parts,
    error_code,
    hook_client,
    not_implemented,
    precondition_failed,
    read_body,
    s3_error,
    signs_payload,
)
from stagerd.sinks.s3.conditions import Conditions, Support, leave, probe
from stagerd.sinks.s3.endpoint import check_endpoint
from stagerd.sinks.s3.latest import LatestMixin
from stagerd.sinks.s3.opening import OpeningMixin
from stagerd.sinks.s3.pending import PendingMixin
from stagerd.sinks.s3.upload import S3Api, one_put, upload_files

log = logging.getLogger("stagerd.sinks.s3")

MIN_PART = 5 << 20
MAX_PARTS = 10_000


def part_size_for(size: int, part_size: int) -> int:
    """`part_size`, or more (in MiB steps) where a file of `size` bytes would need over 10,000 parts."""
    need = -(-size // MAX_PARTS)
    if need <= part_size:
        return part_size
    mib = 1 << 20
    return -(-need // mib) * mib


def _retries_configured() -> bool:
    """Whether the AWS environment or config file sets the client's retries (`AWS_MAX_ATTEMPTS`,
    `AWS_RETRY_MODE`, `max_attempts`, `retry_mode`): a `max_attempts=` of the sink's gives way to them."""
    import botocore.exceptions
    import botocore.session

    if os.environ.get("AWS_MAX_ATTEMPTS") or os.environ.get("AWS_RETRY_MODE"):
        return True
    try:  # the profile's section of the config file (botocore's `retry_mode` has a default: not asked)
        scoped = botocore.session.get_session().get_scoped_config()
    except botocore.exceptions.ProfileNotFound:
        return False  # the client names that itself
    return "max_attempts" in scoped or "retry_mode" in scoped


class S3Backend(OpeningMixin, LatestMixin, PendingMixin):
    """S3 and compatible stores (MinIO, Ceph, R2) through s3fs's session, honouring the AWS environment.

    Every object is uploaded with a checksum (`checksum=`: CRC32 by default, or SHA256) the store verifies
    on receipt and reports back: the plain one for a single PUT, the composite of per-part ones for
    multipart. Retries are botocore's
    (bounded exponential backoff for 5xx, throttling, 429 and dropped connections; tune with
    AWS_RETRY_MODE / AWS_MAX_ATTEMPTS or `config_kwargs`); nothing here retries on top of them. The
    option `max_attempts` (a `--once` run's) sets botocore's tries of a request where none of those do.
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
        self._opened: set[str] = set()  # step prefixes opened before: a retry sends nothing early
        self._claimed: set[str] = set()  # step prefixes whose claim this backend created or found its own
        self._latest: dict[str, Latest] = {}  # each `latest` key as last read or written here
        self._latest_reads: dict[str, asyncio.Future[Latest]] = {}  # prefetches not yet used
        self._hooked: Any = None
        self._conditions: asyncio.Future[Conditions] | None = None  # the probe's, once it has run
        self._tidy: asyncio.Future[None] | None = None  # the deletion of the probe's scratch keys
        self.signs_payload = False  # until the client is known: hash every file here, as always safe

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
        check_endpoint(opts)  # before s3fs: botocore finds a bad one only at the first request
        attempts = opts.pop("max_attempts", None)
        config = {"max_pool_connections": max(10, 2 * max_concurrency), **dict(opts.pop("config_kwargs", {}))}
        if attempts is not None and "retries" not in config and not _retries_configured():
            config["retries"] = {"total_max_attempts": int(attempts)}
        # our own instance: settings here must not leak into other users of s3fs's instance cache
        fs = s3fs.S3FileSystem(skip_instance_cache=True, config_kwargs=config, **opts)
        bucket, _, root = fs._strip_protocol(url).partition("/")
        if not bucket:
            raise ConfigError(f"{redact_url(url)}: an S3 sink URL needs a bucket: s3://BUCKET/PREFIX")
        return cls(fs, bucket, root, part_size, max_concurrency, checksum)

    def key(self, key: str) -> str:
        return f"{self.root}/{key}" if self.root else key

    def where(self, key: str) -> str:
        return f"{self.base}/{key}"

    def _run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        from fsspec.asyn import sync

        try:
            return sync(self.fs.loop, fn, *args, **kwargs)
        except SinkMissingError as e:  # whichever request met it first: the sink is what is missing
            raise SinkMissingError(e.message, path=self.base, hint=e.hint) from None

    async def _client(self) -> Any:
        s3 = await self.fs.set_session()
        if s3 is not self._hooked:  # a new client (the first, or s3fs made another)
            hook_client(s3)
            await build_lazy_parts(s3)
            self.signs_payload, self._hooked = signs_payload(s3), s3
        return s3

    async def call(self, where: str, method: str, **kwargs: Any) -> Any:
        s3 = await self._client()
        try:
            return await getattr(s3, method)(Bucket=self.bucket, **kwargs)
        except Exception as e:
            raise s3_error(e, where) from None

    async def conditions(self, *, tidied: bool = False) -> Conditions:
        """What the store does with conditional requests, probed before the first (`s3/conditions.py`);
        `tidied`: once the probe's scratch keys are deleted too."""
        if self._conditions is None:

            async def probed() -> Conditions:
                found, self._tidy = await probe(self)
                return found

            self._conditions = asyncio.ensure_future(probed())
        try:
            found = await asyncio.shield(self._conditions)
        except Exception:
            self._conditions = None  # a probe that failed is run again by the next caller
            raise
        if tidied and self._tidy is not None:
            await self._tidy
        return found

    # -- small operations ----------------------------------------------------------------------------------

    def list(self, prefix: str) -> dict[str, RemoteObject]:
        return self._run(self._list, prefix)

    async def _list(self, prefix: str) -> dict[str, RemoteObject]:
        # pages by hand, not botocore's paginator: a fresh client's first paginator loads the paginator
        # models from disk, ~17 ms on the event loop before the step's first request goes out
        s3 = await self._client()
        base = self.key(prefix) + "/"
        out: dict[str, RemoteObject] = {}
        outside: builtins.list[str] = []
        args = {"Bucket": self.bucket, "Prefix": base}
        try:
            while True:
                page = await s3.list_objects_v2(**args)
                for o in page.get("Contents", []):
                    rel = under(base, o["Key"], outside)
                    if rel is not None:
                        out[rel] = RemoteObject(int(o["Size"]))
                if not page.get("IsTruncated"):
                    skipped(self.where(prefix), outside)
                    return out
                args["ContinuationToken"] = page["NextContinuationToken"]
        except Exception as e:
            raise s3_error(e, self.where(prefix)) from None

    def checksums(self, prefix: str, rels: builtins.list[str]) -> dict[str, str | None]:
        async def one(rel: str, sem: asyncio.Semaphore) -> tuple[str, str | None]:
            key = f"{prefix}/{rel}"
            async with sem:
                r = await self.call(self.where(key), "head_object", Key=self.key(key), ChecksumMode="ENABLED")
            return rel, r.get(f"Checksum{self.algorithm}")

        async def go() -> dict[str, str | None]:
            sem = asyncio.Semaphore(self.max_concurrency)
            return dict(await asyncio.gather(*(one(r, sem) for r in rels)))

        return self._run(go)

    def discard(self, keys: builtins.list[tuple[str, str | None]]) -> None:
        """Delete what this publisher created, each only while it still holds our version (`If-Match` on
        the ETag the store gave our PUT): another publisher's object written there since stays. A store
        without that condition keeps them all, named in one warning: a plain DELETE could remove a file
        another publisher wrote there since."""

        async def one(key: str, etag: str | None) -> None:
            if etag is None:
                return
            try:
                s3 = await self._client()
                await s3.delete_object(Bucket=self.bucket, Key=self.key(key), IfMatch=etag)
            except Exception as e:
                if not precondition_failed(e) and error_code(e)[0] not in ("NoSuchKey", "404"):
                    log.warning("left %s in place: %s", self.where(key), s3_error(e, self.where(key)))

        async def go() -> None:
            support = (await self.conditions()).delete
            if support is not Support.HONOURED:
                return leave(self, [k for k, t in keys if t is not None], support)
            await asyncio.gather(*(one(k, t) for k, t in keys))

        self._run(go)

    def read(self, key: str, limit: int | None = None) -> bytes | None:
        return self._run(self._get, key, limit)

    async def _get(self, key: str, limit: int | None = None) -> bytes | None:
        s3 = await self._client()
        try:
            return await read_body(await s3.get_object(Bucket=self.bucket, Key=self.key(key)), limit)
        except s3.exceptions.NoSuchKey:
            return None
        except Exception as e:
            raise s3_error(e, self.where(key)) from None

    async def put_new(self, where: str, **kwargs: Any) -> dict[str, Any] | None:
        """`PutObject` only if the key is free: the answer, or None when it is taken. A store without
        conditional writes also gives None: the file then goes the checked way (listing, HEAD, upload)."""
        s3 = await self._client()
        try:
            answer: dict[str, Any] = await s3.put_object(Bucket=self.bucket, IfNoneMatch="*", **kwargs)
            return answer
        except Exception as e:
            if precondition_failed(e) or not_implemented(e):
                return None
            raise s3_error(e, where) from None

    def write(self, key: str, data: bytes) -> None:
        self._run(self.call, self.where(key), "put_object", **self._put_args(key, data))

    def create(self, key: str, data: bytes) -> bool:
        return bool(self._run(self._create, key, data))

    async def _create(self, key: str, data: bytes) -> bool:
        """`PutObject` with `If-None-Match: *`; a store that does not implement it, or ignores it, gets
        exists-then-put."""
        s3 = await self._client()
        args = self._put_args(key, data)
        if (await self.conditions()).create is Support.IGNORED:  # the probe said so, once
            return await self._exists_then_put(key, args)
        try:
            await s3.put_object(Bucket=self.bucket, IfNoneMatch="*", **args)
            return True
        except Exception as e:
            if precondition_failed(e):
                return False
            if not not_implemented(e):
                raise s3_error(e, self.where(key)) from None
        log.warning("%s does not support conditional writes; using exists-then-put", self.base)
        return await self._exists_then_put(key, args)

    async def _exists_then_put(self, key: str, args: dict[str, Any]) -> bool:
        if await self._exists(key):
            return False
        await self.call(self.where(key), "put_object", **args)
        return True

    async def _exists(self, key: str) -> bool:
        s3 = await self._client()
        try:
            await s3.head_object(Bucket=self.bucket, Key=self.key(key))
            return True
        except Exception as e:
            err = getattr(e, "response", {}).get("Error", {})
            if err.get("Code") in ("404", "NoSuchKey", "NotFound"):
                return False
            raise s3_error(e, self.where(key)) from None

    def _put_args(self, key: str, data: bytes, checksum: str | None = None) -> dict[str, Any]:
        if checksum is None:
            checksum = b64(raw_checksum(data, self.algorithm))
        return {"Key": self.key(key), "Body": data, **self._checksum_args(checksum)}

    def _checksum_args(self, checksum: str) -> dict[str, str]:
        # the algorithm header makes stores (and moto) keep the checksum and report it back
        return {"ChecksumAlgorithm": self.algorithm, f"Checksum{self.algorithm}": checksum}

    def digest(self, f: LocalFile) -> Uploaded:
        part = self.part_size_of(f.size)
        d = hash_file(f.path, None if one_put(f.size, part) else part, self.algorithm)
        return Uploaded(f.rel, d.size, d.sha256, d.checksum)

    def close(self) -> None:
        import s3fs

        # A probe whose caller was cancelled (a failed gather's sibling) goes on alone: waited for, its
        # failure taken, so closing never destroys it pending nor leaves its exception unretrieved.
        for pending in (self._conditions, self._tidy):
            if pending is None:
                continue
            if not pending.done():
                self._run(asyncio.wait, [pending])
            if pending.done() and not pending.cancelled():
                pending.exception()
        if getattr(self.fs, "_s3", None) is not None:
            s3fs.S3FileSystem.close_session(self.fs.loop, self.fs._s3)
            self.fs._s3 = None

    # -- uploads (s3/upload.py) -----------------------------------------------------------------------------

    def upload(
        self, prefix: str, files: builtins.list[LocalFile], progress: ByteProgress
    ) -> builtins.list[Uploaded]:
        """Upload every file, up to `max_concurrency` parts in flight (and in memory) at a time."""
        api: S3Api = self
        return self._run(upload_files, api, prefix, files, progress)

    def part_size_of(self, size: int) -> int:
        return part_size_for(size, self.part_size)
