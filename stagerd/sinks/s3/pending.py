"""Multipart uploads left pending on S3: those under a step's prefix, listed and aborted (a crashed
publisher's, before a step is published again; a pruned step's, by retention), and one upload of this
publisher's that failed, aborted at once. S3 keeps (and bills) the parts of each until it is aborted.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from stagerd.sinks.listed import under
from stagerd.sinks.s3.client import error_code, s3_error

log = logging.getLogger("stagerd.sinks.s3")


class PendingMixin:
    """The S3 backend's pending multipart uploads: what it needs from the backend is declared here."""

    bucket: str
    _client: Callable[[], Awaitable[Any]]
    _run: Callable[..., Any]
    key: Callable[[str], str]
    where: Callable[[str], str]

    def sweep(self, prefix: str, *, settled: bool = False) -> None:
        self._run(self._sweep, prefix)  # every pending upload under it: one publisher owns a step

    async def _sweep(self, prefix: str) -> None:
        """Abort multipart uploads pending under `prefix/` (one publisher owns a step, and it is here).
        Best effort: credentials without s3:ListBucketMultipartUploads leave them to a lifecycle rule."""
        try:
            await self.abort_uploads(await self.pending_uploads(prefix))
        except Exception as e:
            log.warning(
                "cannot abort stale multipart uploads under %s: %s", self.where(prefix), s3_error(e, "")
            )

    async def pending_uploads(self, prefix: str) -> list[tuple[str, str]]:
        """(bucket key, UploadId) of each multipart upload pending under `prefix/`: S3's literal `Prefix`,
        with its slash, and each key checked again as under it (a store may ignore `Prefix`)."""
        s3 = await self._client()
        args = {"Bucket": self.bucket, "Prefix": self.key(prefix) + "/"}
        out: list[tuple[str, str]] = []
        while True:  # pages by hand, as the backend's `_list` does
            page = await s3.list_multipart_uploads(**args)
            ups = page.get("Uploads", [])
            out += [(u["Key"], u["UploadId"]) for u in ups if under(args["Prefix"], u["Key"]) is not None]
            if not page.get("IsTruncated"):
                return out
            args.update(KeyMarker=page["NextKeyMarker"], UploadIdMarker=page["NextUploadIdMarker"])

    async def abort_uploads(self, uploads: list[tuple[str, str]]) -> None:
        """Abort each (exact bucket key, UploadId), all at once: a crashed publisher can leave one per file.
        One already gone (`NoSuchUpload`: completed or aborted meanwhile) is fine."""
        s3 = await self._client()

        async def one(key: str, upload: str) -> None:
            try:
                await s3.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload)
            except Exception as e:
                if error_code(e)[0] not in ("NoSuchUpload", "404"):
                    raise

        await asyncio.gather(*(one(k, u) for k, u in uploads))

    async def abort(self, key: str, upload_id: str) -> None:
        """Best effort: a store that is down keeps the parts until a lifecycle rule reaps them."""
        try:
            s3 = await self._client()
            await asyncio.wait_for(
                s3.abort_multipart_upload(Bucket=self.bucket, Key=self.key(key), UploadId=upload_id), 30
            )
        except Exception as e:
            log.warning("could not abort the multipart upload of %s: %s", self.where(key), type(e).__name__)
