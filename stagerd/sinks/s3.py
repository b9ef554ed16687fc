"""The S3 backend: s3fs's session and event loop, the aiobotocore client called directly.

Files of two parts or more go up as parallel multipart uploads, each part with a checksum the store
verifies (the schedule is in `s3_upload.py`); the manifest is created with `If-None-Match: *`.
"""

from __future__ import annotations

import asyncio
import builtins
import logging
import urllib.parse
from collections.abc import Callable, Mapping
from typing import Any

from stagerd.errors import ConfigError, SinkAuthError, SinkError
from stagerd.sinks.hashing import ALGORITHMS, b64, hash_file, raw_checksum
from stagerd.sinks.objects import ByteProgress, LocalFile, RemoteObject, Uploaded, redact_url
from stagerd.sinks.s3_upload import S3Api, one_put, upload_files

log = logging.getLogger("stagerd.sinks.s3")

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

    Every object is uploaded with a checksum (`checksum=`: CRC32 by default, or SHA256) the store verifies
    on receipt and reports back: the plain one for a single PUT, the composite of per-part ones for
    multipart. Retries are botocore's
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

    def key(self, key: str) -> str:
        return f"{self.root}/{key}" if self.root else key

    def where(self, key: str) -> str:
        return f"{self.base}/{key}"

    def _run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        from fsspec.asyn import sync

        return sync(self.fs.loop, fn, *args, **kwargs)

    async def _client(self) -> Any:
        return await self.fs.set_session()

    async def call(self, where: str, method: str, **kwargs: Any) -> Any:
        s3 = await self._client()
        try:
            return await getattr(s3, method)(Bucket=self.bucket, **kwargs)
        except Exception as e:
            raise s3_error(e, where) from None

    # -- small operations ----------------------------------------------------------------------------------

    def list(self, prefix: str) -> dict[str, RemoteObject]:
        return self._run(self._list, prefix)

    async def _list(self, prefix: str) -> dict[str, RemoteObject]:
        s3 = await self._client()
        base = self.key(prefix) + "/"
        out: dict[str, RemoteObject] = {}
        try:
            async for page in s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=base):
                for o in page.get("Contents", []):
                    out[o["Key"][len(base) :]] = RemoteObject(int(o["Size"]))
        except Exception as e:
            raise s3_error(e, self.where(prefix)) from None
        return out

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

    def sweep(self, prefix: str) -> None:
        self._run(self._sweep, prefix)

    async def _sweep(self, prefix: str) -> None:
        """Abort multipart uploads pending under `prefix/` (one publisher owns a step, and it is here).
        Best effort: credentials without s3:ListBucketMultipartUploads leave them to a lifecycle rule.
        The aborts of a page go out together: a crashed publisher can leave one per file."""
        s3 = await self._client()
        base = self.key(prefix) + "/"
        try:
            pages = s3.get_paginator("list_multipart_uploads").paginate(Bucket=self.bucket, Prefix=base)
            async for page in pages:
                stale = [(u["Key"], u["UploadId"]) for u in page.get("Uploads", [])]
                await asyncio.gather(
                    *(s3.abort_multipart_upload(Bucket=self.bucket, Key=k, UploadId=u) for k, u in stale)
                )
        except Exception as e:
            log.warning(
                "cannot abort stale multipart uploads under %s: %s", self.where(prefix), s3_error(e, "")
            )

    def open_step(self, prefix: str, manifest_key: str) -> tuple[bytes | None, dict[str, RemoteObject]]:
        """The sweep and the listing at once, then the manifest only if the listing shows one: S3's
        listings are strongly consistent, and a fresh step (the usual case) then costs no GET that 404s.
        The sweep lists pending uploads before this publisher has created any, so it never aborts its own.
        """

        async def go() -> tuple[bytes | None, dict[str, RemoteObject]]:
            _, listed = await asyncio.gather(self._sweep(prefix), self._list(prefix))
            name = manifest_key[len(prefix) + 1 :] if manifest_key.startswith(prefix + "/") else None
            if name is not None and name not in listed:
                return None, listed
            return await self._get(manifest_key), listed

        return self._run(go)

    def create_and_read(self, key: str, data: bytes, other: str) -> tuple[bool, bytes | None]:
        async def go() -> tuple[bool, bytes | None]:
            created, got = await asyncio.gather(
                self._create(key, data), self._get(other), return_exceptions=True
            )
            if isinstance(created, BaseException):
                raise created
            if isinstance(got, BaseException):
                raise got
            return created, got

        return self._run(go)

    def read(self, key: str) -> bytes | None:
        return self._run(self._get, key)

    async def _get(self, key: str) -> bytes | None:
        s3 = await self._client()
        try:
            r = await s3.get_object(Bucket=self.bucket, Key=self.key(key))
            async with r["Body"] as body:
                return bytes(await body.read())
        except s3.exceptions.NoSuchKey:
            return None
        except Exception as e:
            raise s3_error(e, self.where(key)) from None

    def write(self, key: str, data: bytes) -> None:
        self._run(self.call, self.where(key), "put_object", **self._put_args(key, data))

    def create(self, key: str, data: bytes) -> bool:
        return bool(self._run(self._create, key, data))

    async def _create(self, key: str, data: bytes) -> bool:
        """`PutObject` with `If-None-Match: *`; a store that does not implement it gets exists-then-put."""
        from botocore.exceptions import ClientError

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
                raise s3_error(e, self.where(key)) from None
        except Exception as e:
            raise s3_error(e, self.where(key)) from None
        log.warning("%s does not support conditional writes; using exists-then-put", self.base)
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

        if getattr(self.fs, "_s3", None) is not None:
            s3fs.S3FileSystem.close_session(self.fs.loop, self.fs._s3)
            self.fs._s3 = None

    # -- uploads (s3_upload.py) -----------------------------------------------------------------------------

    def upload(
        self, prefix: str, files: builtins.list[LocalFile], progress: ByteProgress
    ) -> builtins.list[Uploaded]:
        """Upload every file, up to `max_concurrency` parts in flight (and in memory) at a time."""
        api: S3Api = self
        return self._run(upload_files, api, prefix, files, progress)

    def part_size_of(self, size: int) -> int:
        return part_size_for(size, self.part_size)

    async def abort(self, key: str, upload_id: str) -> None:
        """Best effort: a store that is down keeps the parts until a lifecycle rule reaps them."""
        try:
            s3 = await self._client()
            await asyncio.wait_for(
                s3.abort_multipart_upload(Bucket=self.bucket, Key=self.key(key), UploadId=upload_id), 30
            )
        except Exception as e:
            log.warning("could not abort the multipart upload of %s: %s", self.where(key), type(e).__name__)
