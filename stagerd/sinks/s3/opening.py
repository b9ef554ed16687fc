"""A step's opening on S3: its first round trip, claim, listing, `latest` and small files all at once."""

from __future__ import annotations

import asyncio
import builtins
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, cast

from stagerd.contract.manifest import MAX_MANIFEST_BYTES
from stagerd.sinks.objects import (
    MAX_CLAIM_BYTES,
    ByteProgress,
    Claiming,
    LocalFile,
    RemoteObject,
    StepOpening,
)
from stagerd.sinks.s3.conditions import Conditions, Support
from stagerd.sinks.s3.upload import S3Api, one_put, put_new_files

_MANIFEST, _CLAIM = MAX_MANIFEST_BYTES + 1, MAX_CLAIM_BYTES + 1  # one past each limit: the readers refuse it


class OpeningMixin:
    """The S3 backend's `open_step`: what it needs from the backend is declared here (the backend is also
    the `S3Api` its uploads take)."""

    _opened: set[str]
    _claimed: set[str]
    _conditions: asyncio.Future[Conditions] | None
    _tidy: asyncio.Future[None] | None
    _latest_reads: dict[str, asyncio.Future[Any]]
    _run: Callable[..., Any]
    _list: Callable[[str], Awaitable[dict[str, RemoteObject]]]
    _get: Callable[..., Awaitable[bytes | None]]
    _create: Callable[[str, bytes], Awaitable[bool]]
    _sweep: Callable[[str], Coroutine[Any, Any, None]]
    _prefetch_latest: Callable[[str], None]
    conditions: Callable[..., Awaitable[Conditions]]
    part_size_of: Callable[[int], int]

    def open_step(
        self,
        prefix: str,
        manifest_key: str,
        latest_key: str,
        files: builtins.list[LocalFile],
        progress: ByteProgress,
        claim: Claiming,
    ) -> StepOpening:
        """The step's first round trip, all at once: the step's claim (a create-only PUT, `claims.py`), the
        object listing, the read of `latest` (unless this backend wrote it last), and create-only PUTs
        (`If-None-Match: *`) of the files under two parts, which cannot overwrite anything and so need not
        wait for the listing (none where the probe found that condition not honoured). The manifest is
        then fetched only if the listing shows one (S3 lists consistently). A prefix this backend opened
        before (a retry) sends nothing early: its files are likely there, and the checked path reuses them
        without sending their bytes again.

        A claim found taken is read, with the manifest, in a second round trip: this publisher's own (a
        restart or a retry) is followed by the sweep of pending multipart uploads (what a killed run of it
        left), before any multipart upload of this run starts, so the sweep never aborts one of ours;
        another's is returned for the sink to refuse. A fresh claim needs no sweep: no publisher of this
        step came before (**departure**: a stale upload from before claims existed is left to the bucket's
        `AbortIncompleteMultipartUpload` lifecycle rule), and a loser never sweeps a winner's uploads.

        A step whose files all go in one PUT (a small step) opens with its PUTs, the claim and the read of
        `latest`, without the listing: a PUT refused on a taken key sends the step down the listed path
        after all, and a published manifest refuses ours at the end (`FsspecSink._publish_tree`)."""
        eager = [f for f in files if one_put(f.size, self.part_size_of(f.size))]
        if prefix in self._opened:
            eager = []
        self._opened.add(prefix)
        small = bool(eager) and len(eager) == len(files)

        async def listed() -> tuple[dict[str, RemoteObject], bytes | None]:
            objects = await self._list(prefix)
            name = manifest_key[len(prefix) + 1 :] if manifest_key.startswith(prefix + "/") else None
            found = name is None or name in objects
            return objects, await self._get(manifest_key, _MANIFEST) if found else None

        async def claiming() -> bytes | None:
            """None: created now; else the claim there (read back only if this backend claimed it before,
            so a retry writes nothing)."""
            if prefix in self._claimed and claim.owns(held := await self._get(claim.key, _CLAIM)):
                return held
            return None if await self._create(claim.key, claim.data) else b""

        async def go() -> StepOpening:
            nonlocal eager, small
            try:
                if eager and (self._conditions is None or not self._conditions.done()):
                    self._prefetch_latest(latest_key)  # beside the probe, which the PUTs wait for
                if eager and (await self.conditions()).create is not Support.HONOURED:
                    eager, small = [], False  # a PUT would overwrite whatever the key holds
                puts = asyncio.ensure_future(put_new_files(cast(S3Api, self), prefix, eager, progress))
                claimed = asyncio.ensure_future(claiming())
                self._prefetch_latest(latest_key)  # after the PUTs: they go out first
                opening = await opened(puts, claimed)
                if self._tidy is not None:  # the probe's scratch keys, deleted beside the opening
                    await self._tidy
                return opening
            except Exception:
                read = self._latest_reads.get(latest_key)
                if read is not None:  # a failed opening leaves nothing it started in flight
                    await asyncio.wait([read])
                raise

        async def opened(puts: asyncio.Future[Any], claimed: asyncio.Future[bytes | None]) -> StepOpening:
            listing = None if small else asyncio.ensure_future(listed())
            children = [puts, claimed, *([listing] if listing is not None else [])]
            try:
                (created, refused), held, *rest = await asyncio.gather(*children)
            except BaseException:
                for c in children:  # a failed gather leaves its other children running: stop them
                    c.cancel()
                await asyncio.gather(*children, return_exceptions=True)
                raise
            objects, existing = rest[0] if rest else (None, None)
            if held is None and small and not refused:
                self._claimed.add(prefix)
                return StepOpening(None, None, created, [], claimed=True)
            ours = held is None or claim.owns(held)
            if not ours:  # a restart of ours, or another publisher: read it, and the manifest again
                held, (objects, existing) = await asyncio.gather(self._get(claim.key, _CLAIM), listed())
                ours = claim.owns(held)
            elif objects is None:
                objects, existing = await listed()
            if ours:
                self._claimed.add(prefix)
                if held is not None:  # claimed before, by this run or a killed one: what it left pending
                    await self._sweep(prefix)
            return StepOpening(existing, objects, created, refused, claimed=ours, claim=held)

        return self._run(go)
