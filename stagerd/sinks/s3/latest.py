"""`latest` on S3: read once, written only forward and only over the version known.

The read of `latest` goes out with a step's first requests (`_prefetch_latest`); `move_latest` takes its
answer, or this backend's own last write of the key, and writes conditionally on that version (`If-Match`,
or `If-None-Match: *` where it was absent). A write refused because `latest` changed reads it again, so it
moves only forward, also against a writer between the read and the write.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from stagerd.errors import SinkError
from stagerd.sinks.objects import MAX_LATEST_BYTES, Latest, foreign_latest, newer_latest
from stagerd.sinks.s3.client import error_code, not_implemented, precondition_failed, read_body, s3_error

log = logging.getLogger("stagerd.sinks.s3")

LATEST_TRIES = 10


class LatestMixin:
    """The S3 backend's `latest`: what it needs from the backend is declared here."""

    bucket: str
    base: str
    _latest: dict[str, Latest]  # each `latest` key as last read or written here
    _latest_reads: dict[str, asyncio.Future[Latest]]  # prefetches not yet used
    _client: Callable[[], Awaitable[Any]]
    _run: Callable[..., Any]
    key: Callable[[str], str]
    where: Callable[[str], str]
    call: Callable[..., Awaitable[Any]]
    _put_args: Callable[..., dict[str, Any]]

    def _prefetch_latest(self, key: str) -> None:
        """Start reading `latest` unless its version is known here; `move_latest` takes the answer."""
        if key not in self._latest and key not in self._latest_reads:
            read = asyncio.ensure_future(self._read_latest(key))
            read.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieved, or read again
            self._latest_reads[key] = read

    async def _known_latest(self, key: str) -> Latest:
        """`latest` as prefetched, else as last written or read here, else as read now."""
        read = self._latest_reads.pop(key, None)
        if read is not None:
            try:
                return await read
            except SinkError:
                pass  # read again below, and fail there if it fails again
        known = self._latest.get(key)
        return known if known is not None else await self._read_latest(key)

    async def _read_latest(self, key: str) -> Latest:
        s3 = await self._client()
        try:
            r = await s3.get_object(Bucket=self.bucket, Key=self.key(key))
            latest = Latest(await read_body(r, MAX_LATEST_BYTES + 1), r.get("ETag"))
        except Exception as e:
            if error_code(e)[0] not in ("NoSuchKey", "404"):
                raise s3_error(e, self.where(key)) from None
            latest = Latest(None)
        self._latest[key] = latest
        return latest

    def move_latest(self, key: str, name: bytes, step: int) -> None:
        """`latest` moves only forward, judged on what it holds when written: each write is conditional on
        the version known (`If-Match`, or `If-None-Match: *` where it was absent): read while the step
        opened, or this backend's own last write of it (a daemon's sink, step after step, then
        reads it no more). A write that finds it changed reads it again. A store without conditional
        writes gets read-then-write."""

        async def go() -> None:
            cur = await self._known_latest(key)
            for _ in range(LATEST_TRIES):
                foreign_latest(cur.data, self.where(key))
                if not newer_latest(cur.data, step) or cur.data == name:
                    return
                cond = {"IfMatch": cur.etag} if cur.data is not None and cur.etag else {"IfNoneMatch": "*"}
                try:
                    answer = await (await self._client()).put_object(
                        Bucket=self.bucket, **self._put_args(key, name), **cond
                    )
                    self._latest[key] = Latest(name, answer.get("ETag"))
                    return
                except Exception as e:
                    if not_implemented(e):
                        log.warning(
                            "%s does not support conditional writes; using read-then-write", self.base
                        )
                        cur = await self._read_latest(key)
                        if newer_latest(cur.data, step) and cur.data != name:
                            await self.call(self.where(key), "put_object", **self._put_args(key, name))
                        return
                    # If-Match on a key deleted meanwhile is a 404
                    if not precondition_failed(e) and error_code(e)[0] not in ("NoSuchKey", "404"):
                        raise s3_error(e, self.where(key)) from None
                cur = await self._read_latest(key)
            raise SinkError(
                f"latest changed under each of {LATEST_TRIES} conditional writes",
                path=self.where(key),
                hint="other publishers keep moving it; the step's manifest is written, a retry moves latest",
            )

        self._run(go)
