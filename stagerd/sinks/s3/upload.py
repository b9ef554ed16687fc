"""One step's uploads to S3: the order parts go out in, hashing beside the sends, and what the store's
answers prove.

- **Order.** One producer reads parts in file order: files that go in one PUT first, smallest first
  (under two parts; they cost a request each and would otherwise wait behind the big ones), then each
  multipart file's parts in turn. A file's `CompleteMultipartUpload` therefore runs while the next file's
  parts are sent, instead of every file finishing at once at the end (moto spends seconds assembling
  500 MB; S3 also takes a while).
- **Memory.** `max_concurrency` slots: a part holds one from its read until it is sent.
  Parts are read into `bytearray`s that go back to a free list when their part is done, so a publish
  zero-fills and faults in at most `max_concurrency` of them.
- **Hashing.** A worker thread reads each part, 1 MiB at a time, and hashes each MiB while it is still in
  the CPU's cache (`hashing.read_hashed`): the store checksum (CRC32 by default), since its header goes
  out with the part; where the client signs bodies (plain http), the part's sha256 for the signature
  (`s3/client.py`: the signer takes it instead of hashing on the event loop); and the file's running
  sha256 for the manifest, which the parts reach in file order because one file's parts are read one
  after the other. A file in one PUT is hashed once: its sha256 is both the signed one and the
  manifest's.
- **Verification.** A `PutObject` or `CompleteMultipartUpload` answer that carries the object's checksum
  proves what the store holds (it verified the body against the checksum we sent). Where the answer has
  none (moto's `CompleteMultipartUpload`), the object is HEADed at once, while other files still upload.
  Either way the `Uploaded` is `confirmed`, and the sink does not HEAD it again.
- **Conditional PUTs.** `put_new_files` sends one-PUT files with `If-None-Match: *`, so they can go out
  beside the step's opening listing without the listing's answer: a PUT can then only create, never
  overwrite. A file whose key is taken comes back `refused`, hashed, for the sink's checked path.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
from collections.abc import Awaitable, Coroutine
from dataclasses import dataclass, field
from typing import Any, Protocol

from stagerd.contract.step.reopen import open_held
from stagerd.errors import SinkError
from stagerd.ops.crashpoints import crash_point
from stagerd.sinks.hashing import RunningHash, b64, composite_checksum, read_hashed
from stagerd.sinks.objects import ByteProgress, LocalFile, Uploaded, changed_error, same_checksum
from stagerd.sinks.s3.client import BODY_SHA256


class S3Api(Protocol):
    """What the uploads need from the S3 backend: named calls and key spelling."""

    algorithm: str
    max_concurrency: int
    signs_payload: bool  # the client signs each body's sha256 (`s3/client.py`)

    def part_size_of(self, size: int) -> int:
        """The part size a file of `size` bytes is uploaded in."""
        ...

    def key(self, key: str) -> str:
        """The object key of `key` (relative to the sink's root)."""
        ...

    def where(self, key: str) -> str:
        """`key` as a URL for messages."""
        ...

    def call(self, where: str, method: str, **kwargs: Any) -> Awaitable[dict[str, Any]]:
        """One S3 call on the sink's bucket; failures are named `SinkError`s about `where`."""
        ...

    def put_new(self, where: str, **kwargs: Any) -> Awaitable[dict[str, Any] | None]:
        """`PutObject` with `If-None-Match: *`: its answer, or None when the key already exists."""
        ...

    def abort(self, key: str, upload_id: str) -> Awaitable[None]:
        """Abort a multipart upload, best effort."""
        ...


@dataclass
class _Run:
    """The tasks of one `upload()` call: the first failure stops the producer and cancels the rest."""

    tasks: set[asyncio.Future[Any]] = field(default_factory=set)
    failure: BaseException | None = None
    pending: dict[str, str] = field(default_factory=dict)  # key -> upload id, until completed

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Future[Any]:
        t = asyncio.ensure_future(coro)
        self.tasks.add(t)
        t.add_done_callback(self._done)
        return t

    def _done(self, t: asyncio.Future[Any]) -> None:
        if not t.cancelled() and t.exception() is not None and self.failure is None:
            self.failure = t.exception()

    def check(self) -> None:
        if self.failure is not None:
            raise self.failure


@dataclass(frozen=True)
class _Part:
    """One part as read: its number, bytes, store checksum (base64) and sha256 hex to sign (or None)."""

    number: int
    data: bytearray
    checksum: str
    sha256: str | None
    reusable: bool  # a part-sized buffer (not a short last part's own): kept for the next part


class Uploads:
    """Uploads a list of files under a prefix; `run()` returns them in the order given."""

    def __init__(
        self,
        api: S3Api,
        prefix: str,
        files: list[LocalFile],
        progress: ByteProgress,
        *,
        conditional: bool = False,
    ) -> None:
        self.api, self.prefix, self.files, self.progress = api, prefix, files, progress
        self.slots = asyncio.Semaphore(api.max_concurrency)
        self.run_ = _Run()
        self.conditional = conditional  # one-PUT files only create: a taken key is `refused`
        self.refused: set[str] = set()
        self.spares: dict[int, list[bytearray]] = {}  # part buffers free again, by size

    async def run(self) -> list[Uploaded]:
        single = sorted(
            (f for f in self.files if one_put(f.size, self.api.part_size_of(f.size))), key=lambda f: f.size
        )  # smallest first: a config file must not wait for slots behind four 25 MB PUTs
        multi = [f for f in self.files if not one_put(f.size, self.api.part_size_of(f.size))]
        results: dict[str, asyncio.Future[Uploaded]] = {}
        run = self.run_
        try:
            await run.spawn(self._produce(single, multi, results))
            done = {rel: await t for rel, t in results.items()}
        except BaseException as e:
            for t in run.tasks:
                t.cancel()
            await asyncio.gather(*run.tasks, return_exceptions=True)
            await asyncio.gather(*(self.api.abort(k, u) for k, u in run.pending.items()))
            if isinstance(e, asyncio.CancelledError) or run.failure is None:
                raise
            raise run.failure from None  # the first failure, not whichever task was awaited
        return [done[f.rel] for f in self.files]

    async def _produce(
        self, single: list[LocalFile], multi: list[LocalFile], results: dict[str, asyncio.Future[Uploaded]]
    ) -> None:
        for f in single:  # each read in its own task: many small files need not queue behind one reader
            # a slot per part's worth of memory, but never more slots than there are
            weight = min(self.api.max_concurrency, max(1, -(-f.size // self.api.part_size_of(f.size))))
            for _ in range(weight):
                await self._slot()
            results[f.rel] = self.run_.spawn(self._put(f, weight))
        for f in multi:
            results[f.rel] = await self._multipart(f)

    def _release(self, buf: bytearray, *, slot: bool = True, keep: bool = True) -> None:
        """Give back a part's slot and (`keep`) keep its buffer for the next part of the same size: a reused
        buffer costs no zero-fill and no page faults. A short last part's buffer is not kept, so the free
        list holds at most the `max_concurrency` part-sized buffers, however many files there are."""
        if keep:
            self.spares.setdefault(len(buf), []).append(buf)
        if slot:
            self.slots.release()

    async def _slot(self) -> None:
        await self.slots.acquire()
        if self.run_.failure is not None:
            self.slots.release()
            self.run_.check()

    # -- one PUT ------------------------------------------------------------------------------------------

    async def _put(self, f: LocalFile, weight: int) -> Uploaded:
        """One PUT of the whole file. Its sha256, taken with the read, is both the manifest's and (where the
        client signs bodies) the signed payload hash the store checks the body against."""
        api, key = self.api, f"{self.prefix}/{f.rel}"
        try:
            data, raw, sha256 = await asyncio.to_thread(_read_whole, f, api.algorithm)
            checksum = b64(raw)
            args: dict[str, Any] = {"Key": api.key(key), "Body": data, "ChecksumAlgorithm": api.algorithm}
            args[f"Checksum{api.algorithm}"] = checksum
            if api.signs_payload:
                args[BODY_SHA256] = sha256
            answer: dict[str, Any] | None
            if self.conditional:
                answer = await api.put_new(api.where(key), **args)
            else:
                answer = await api.call(api.where(key), "put_object", **args)
        finally:
            for _ in range(weight):
                self.slots.release()
        if answer is None:
            self.refused.add(f.rel)
            return Uploaded(f.rel, len(data), sha256, checksum)
        self.progress(len(data))
        confirmed = await self._confirm(key, checksum, answer)
        return Uploaded(f.rel, len(data), sha256, checksum, confirmed, answer.get("ETag"))

    # -- multipart ----------------------------------------------------------------------------------------

    async def _multipart(self, f: LocalFile) -> asyncio.Future[Uploaded]:
        """Read and send every part of `f` (returns once the last part is on its way), and a future for
        the finished upload."""
        api, run, key = self.api, self.run_, f"{self.prefix}/{f.rel}"
        where = api.where(key)
        part_size = api.part_size_of(f.size)

        async def create() -> str:
            mpu = await api.call(
                where, "create_multipart_upload", Key=api.key(key), ChecksumAlgorithm=api.algorithm
            )
            run.pending[key] = mpu["UploadId"]
            return str(mpu["UploadId"])

        upload_id = run.spawn(create())
        file_sha256 = hashlib.sha256()  # fed by each part's read, one after the other, in file order
        parts: list[asyncio.Future[dict[str, Any]]] = []
        raws: list[bytes] = []
        size = 0
        with open(f.path, "rb", buffering=0, opener=open_held) as fh:
            while True:
                await self._slot()
                spares = self.spares.get(part_size)
                spare = spares.pop() if spares else None
                try:
                    buf, data, raw, digest = await asyncio.to_thread(
                        _read_part, fh, spare, part_size, api.algorithm, api.signs_payload, file_sha256
                    )
                except BaseException:
                    self.slots.release()
                    raise
                if data is not buf:  # the file's last part, in a buffer of its own size
                    self._release(buf, slot=False)
                if not data:
                    self.slots.release()
                    break
                size += len(data)
                if size > f.size:
                    self._release(data, keep=data is buf)
                    raise changed_error(f, size)
                raws.append(raw)
                part = _Part(len(parts) + 1, data, b64(raw), digest, reusable=data is buf)
                parts.append(run.spawn(self._part(key, upload_id, part)))
        if size != f.size:
            raise changed_error(f, size)
        return run.spawn(self._complete(f, key, upload_id, parts, raws, file_sha256.hexdigest()))

    async def _part(
        self,
        key: str,
        upload_id: asyncio.Future[Any],
        part: _Part,
    ) -> dict[str, Any]:
        api = self.api
        args: dict[str, Any] = {f"Checksum{api.algorithm}": part.checksum}
        if part.sha256 is not None:
            args[BODY_SHA256] = part.sha256
        try:
            r = await api.call(
                f"{api.where(key)} (part {part.number})",
                "upload_part",
                Key=api.key(key),
                UploadId=await upload_id,
                PartNumber=part.number,
                Body=part.data,
                ChecksumAlgorithm=api.algorithm,
                **args,
            )
        finally:
            self._release(part.data, keep=part.reusable)
        self.progress(len(part.data))
        crash_point("s3.part")
        return {"PartNumber": part.number, "ETag": r["ETag"], f"Checksum{api.algorithm}": part.checksum}

    async def _complete(
        self,
        f: LocalFile,
        key: str,
        upload_id: asyncio.Future[Any],
        parts: list[asyncio.Future[dict[str, Any]]],
        raws: list[bytes],
        sha256: str,
    ) -> Uploaded:
        api = self.api
        done = [await p for p in parts]
        r = await api.call(
            api.where(key),
            "complete_multipart_upload",
            Key=api.key(key),
            UploadId=await upload_id,
            MultipartUpload={"Parts": done},
        )
        self.run_.pending.pop(key, None)
        checksum = composite_checksum(raws, api.algorithm)
        confirmed = await self._confirm(key, checksum, r)
        return Uploaded(f.rel, f.size, sha256, checksum, confirmed)

    # -- what the store says --------------------------------------------------------------------------

    async def _confirm(self, key: str, checksum: str, answer: dict[str, Any]) -> bool:
        """Check `checksum` against the store's answer to the upload, else against a HEAD now. A store
        that reports no checksum at all leaves name and size to the sink's listing, as before."""
        api = self.api
        have = answer.get(f"Checksum{api.algorithm}")
        if not have:
            head = await api.call(api.where(key), "head_object", Key=api.key(key), ChecksumMode="ENABLED")
            have = head.get(f"Checksum{api.algorithm}")
            if not have:
                return True
        if not same_checksum(str(have), checksum):
            raise SinkError(
                f"the store reports checksum {have} after the upload, expected {checksum}",
                path=api.where(key),
                hint="the bytes changed on the way or in the store; the step is retried",
            )
        return True


def one_put(size: int, part_size: int) -> bool:
    """Whether a file goes up in one PUT: under two parts' worth, a multipart upload's two extra round
    trips and the store's assembly of the parts cost more than the parallelism of two parts gains."""
    return size < 2 * part_size


def _read_whole(f: LocalFile, algorithm: str) -> tuple[bytearray, bytes, str]:
    """A file that goes in one PUT, its raw store checksum and its sha256 hex (also the signed one)."""
    data = bytearray(f.size + 1)  # one byte more: a file that grew is caught here
    with open(f.path, "rb", buffering=0, opener=open_held) as fh:
        read = read_hashed(fh, data, algorithm, part_sha256=True)  # the part is the whole file
    del data[read.size :]
    if len(data) != f.size:
        raise changed_error(f, len(data))
    assert read.sha256 is not None  # asked for
    return data, read.checksum, read.sha256


def _read_part(
    fh: io.RawIOBase,
    spare: bytearray | None,
    part_size: int,
    algorithm: str,
    digest: bool,
    file_sha256: RunningHash,
) -> tuple[bytearray, bytearray, bytes, str | None]:
    """The next part of an open file: the part-sized buffer it was read into (`spare`, or a new one: its
    zero-fill and page faults stay off the event loop), the part (that buffer, or for a short last part a
    buffer of its own, so that the part-sized one stays whole for reuse), its raw store checksum and
    (`digest`) its sha256 hex for the signature; an empty part at the end. The part also goes into
    `file_sha256`, in the same pass: parts are read one at a time, in file order."""
    buf = bytearray(part_size) if spare is None else spare
    read = read_hashed(fh, buf, algorithm, file_sha256=file_sha256, part_sha256=digest)
    data = buf if read.size == len(buf) else bytearray(memoryview(buf)[: read.size])
    if not data:
        return buf, data, b"", None
    return buf, data, read.checksum, read.sha256


async def upload_files(
    api: S3Api, prefix: str, files: list[LocalFile], progress: ByteProgress
) -> list[Uploaded]:
    """Upload `files` under `prefix/` on the backend's event loop, in the order and with the checks above."""
    return await Uploads(api, prefix, files, progress).run()


async def put_new_files(
    api: S3Api, prefix: str, files: list[LocalFile], progress: ByteProgress
) -> tuple[list[Uploaded], list[Uploaded]]:
    """Create each of `files` (all of them one-PUT files) with a conditional PUT: (created, refused), the
    refused ones hashed but not sent, because their key already held an object."""
    assert all(one_put(f.size, api.part_size_of(f.size)) for f in files)
    up = Uploads(api, prefix, files, progress, conditional=True)
    done = await up.run()
    return [d for d in done if d.rel not in up.refused], [d for d in done if d.rel in up.refused]
