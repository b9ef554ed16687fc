"""Reading a published step back from an fsspec sink (`stagerd restore`): its manifest, then its files,
checked against the manifest (size, sha256) while they download.

Nothing is trusted before it is checked: the manifest is parsed strictly (a truncated one is an error
naming it), every file it lists must be listed by the store at its size before a byte is downloaded (a
missing object is an error naming it), and every file's sha256 is computed over the bytes as they arrive
and compared once the file is complete. From S3, each object is one streamed GET (`workers` objects at
a time on s3fs's event loop), each chunk written and hashed in a thread as it arrives. From other stores,
files come down as parallel ranged reads (`chunk_size` pieces, `workers` at a time), written in place with
`pwrite` and hashed in order by whichever worker completes the next piece, so memory stays about
`2 * workers * chunk_size`.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from pathlib import Path

from stagerd.contract import layout
from stagerd.contract.manifest import ExportManifest, ManifestFile
from stagerd.errors import RestoreError, SinkConflictError, SinkError, StepVanishedError
from stagerd.ops.crashpoints import crash_point, delay_point
from stagerd.sinks.base import ProgressFn
from stagerd.sinks.objects import ByteProgress, parse_manifest
from stagerd.sinks.remote import MAX_MANIFEST_BYTES, RemoteStore, StoredObject

__all__ = ["MAX_MANIFEST_BYTES", "RemoteStore", "StoredObject"]  # the store lives in remote.py

log = logging.getLogger("stagerd.sinks.fetch")

RAW_DIR = "raw"
LATEST_NAME = "latest"


_NODE_MANIFEST = re.compile(r"(node-([0-9]{5})-of-([0-9]{5}))/" + re.escape(layout.MANIFEST_NAME))


def node_parts(rels: Iterable[str]) -> tuple[list[str], bool]:
    """A node-locally staged raw step's parts (`node-K-of-M`) whose manifests `rels` lists, in node order,
    and whether they are every node's."""
    found = {}
    for rel in rels:
        m = _NODE_MANIFEST.fullmatch(rel)
        if m:
            found[(int(m.group(2)), int(m.group(3)))] = m.group(1)
    counts = {of for _, of in found}
    whole = len(counts) == 1 and sorted(k for k, _ in found) == list(range(next(iter(counts))))
    return [name for _, name in sorted(found.items())], whole


def node_part(node: int, nodes: int) -> str:
    """The raw step's folder of staging node `node` of `nodes` (`node_parts` reads them back)."""
    return f"node-{node:05d}-of-{nodes:05d}"


def step_prefix(step: int, *, raw: bool) -> str:
    name = layout.step_dir_name(step)
    return f"{RAW_DIR}/{name}" if raw else name


def resolve_step(store: RemoteStore, step: int | None, *, raw: bool) -> int:
    """`step`, or the step `latest` names (under `raw/` for raw steps)."""
    if step is not None:
        return step
    key = f"{RAW_DIR}/{LATEST_NAME}" if raw else LATEST_NAME
    data = store.read_latest(key)  # another tool's latest (a directory, a large file) names no step
    if data is None:
        raise missing(store, key, None, raw=raw)
    found = layout.parse_step_dir(data.decode(errors="replace").strip())
    if found is None:
        raise RestoreError(f"names no step: {data[:64]!r}", path=store.where(key))
    return found


def read_manifest(store: RemoteStore, prefix: str, step: int) -> ExportManifest:
    key = f"{prefix}/{layout.MANIFEST_NAME}"
    data = store.read(key)
    if data is None:
        raise missing(store, key, step, raw=prefix.startswith(f"{RAW_DIR}/"))
    try:
        manifest = parse_manifest(data, store.where(key))
    except SinkConflictError as e:
        raise RestoreError(e.message, path=e.path) from None
    if manifest.step != step:
        raise RestoreError(f"is for step {manifest.step}, not {step}", path=store.where(key))
    return manifest


STEPS_SHOWN = 5  # of the steps a sink holds, named when the one asked for is not there


def steps_here(store: RemoteStore, *, raw: bool) -> list[int]:
    """The steps whose manifest (a raw step's: one of its node parts' too) is on the store, newest first."""
    found = set()
    for rel in store.objects(RAW_DIR if raw else "", start="step-"):
        name, _, rest = rel.partition("/")
        step = layout.parse_step_dir(name)
        if step is not None and (rest == layout.MANIFEST_NAME or _NODE_MANIFEST.fullmatch(rest)):
            found.add(step)
    return sorted(found, reverse=True)


def missing(store: RemoteStore, key: str, step: int | None, *, raw: bool) -> RestoreError:
    """The error for a restore whose step (`step`; None: the one `latest` names) is not on the store at
    `key`: it names the steps that are, newest first, or the other kind it holds (exports where raw steps
    were asked for, as a sink published without `--publish-raw` holds) and how to restore those."""
    where = store.where(key)
    what = (
        "no step was published here"
        if step is None
        else "the step was never published here, or not completely"
    )
    try:
        here = steps_here(store, raw=raw)
        other = [] if here else steps_here(store, raw=not raw)
    except SinkError:  # the listing failed too: what was asked for is missing all the same
        return RestoreError(f"is missing: {what}", path=where)
    kind = "raw step" if raw else "exported step"
    pick = step if step in other else (other or here or [0])[0]
    if here:
        return RestoreError(
            f"is missing: {what}; the sink holds {len(here)} {kind}(s): {shown_steps(here)}",
            path=where,
            hint=f"nothing was restored; give one of them with --step N (`--step {here[0]}`: the newest)",
        )
    if other and raw:
        return RestoreError(
            f"is missing: no raw step was published here (`watch --publish-raw`), only {len(other)} exported "
            f"step(s): {shown_steps(other)}",
            path=where,
            hint="nothing was restored; restore an export into a new directory with "
            f"`stagerd restore URL OUT --export --step {pick}`; to resume training from a sink, publish raw "
            "steps to it (`stagerd watch --publish-raw`)",
        )
    if other:
        return RestoreError(
            f"is missing: no HF export was published here, only {len(other)} raw step(s): "
            f"{shown_steps(other)}",
            path=where,
            hint="nothing was restored; restore a raw step into ROOT without --export: "
            f"`stagerd restore URL ROOT --step {pick}`",
        )
    return RestoreError(f"is missing: {what}", path=where)


def shown_steps(steps: list[int]) -> str:
    """A few of `steps` (newest first) as a restore names what a sink holds; the Hub's restore too."""
    more = ", ..." if len(steps) > STEPS_SHOWN else ""
    return ", ".join(map(str, steps[:STEPS_SHOWN])) + more + " (newest first)"


def check_listing(store: RemoteStore, prefix: str, manifest: ExportManifest) -> None:
    """Every file the manifest lists is on the store at its size: checked before anything downloads."""
    have = store.sizes(prefix)
    for f in manifest.files:
        got = have.get(f.path)
        if got is None:
            raise RestoreError(
                "is listed in the manifest but missing on the sink", path=store.where(f"{prefix}/{f.path}")
            )
        if got != f.size:
            raise RestoreError(
                f"is {got} bytes on the sink, the manifest lists {f.size}",
                path=store.where(f"{prefix}/{f.path}"),
            )


class _InOrderHash:
    """sha256 of one file from pieces that complete in any order; each piece is hashed once it is next."""

    def __init__(self) -> None:
        self.h = hashlib.sha256()
        self.next = 0
        self.waiting: dict[int, bytes] = {}
        self.lock = threading.Lock()

    def add(self, offset: int, data: bytes) -> None:
        with self.lock:
            self.waiting[offset] = data
            while self.next in self.waiting:
                piece = self.waiting.pop(self.next)
                self.h.update(piece)  # hashlib releases the GIL for large pieces
                self.next += len(piece)


def download(
    store: RemoteStore,
    prefix: str,
    files: tuple[ManifestFile, ...],
    dest: Path,
    *,
    workers: int = 8,
    chunk_size: int = 32 << 20,
    progress: ProgressFn | None = None,
) -> None:
    """Download `files` under `prefix/` into `dest`, checking size and sha256; fsync every file and dir."""
    prog = ByteProgress(sum(f.size for f in files), progress)
    # A file is open only while a piece is written to it: a raw step has a file per rank and kind, often
    # more than the process may hold open at once (a soft RLIMIT_NOFILE of 1024 is common).
    paths: dict[str, Path] = {}
    hashes: dict[str, _InOrderHash] = {}
    window = threading.BoundedSemaphore(2 * workers)
    failed = threading.Event()

    def land(f: ManifestFile, offset: int, data: bytes) -> None:
        """Write one piece in place and hash it (in file order); any thread."""
        view, pos = memoryview(data), offset
        fd = os.open(paths[f.path], os.O_WRONLY | os.O_CLOEXEC)
        try:
            while view:
                n = os.pwrite(fd, view, pos)
                view, pos = view[n:], pos + n
        finally:
            os.close(fd)
        hashes[f.path].add(offset, data)
        prog(len(data))
        crash_point("restore.piece")
        delay_point("restore.piece")

    def piece(f: ManifestFile, offset: int, length: int) -> None:
        try:
            key = f"{prefix}/{f.path}"
            try:
                data = store.read_range(key, offset, length)
            except FileNotFoundError:
                raise StepVanishedError(
                    "disappeared from the sink during the restore", path=store.where(key)
                ) from None
            except OSError as e:
                raise SinkError(f"{type(e).__name__}: {e}", path=store.where(key)) from None
            if len(data) != length:
                raise RestoreError(
                    f"returned {len(data)} bytes at offset {offset}, expected {length}", path=store.where(key)
                )
            land(f, offset, data)
        except BaseException:
            failed.set()
            raise
        finally:
            window.release()

    for f in files:
        p = dest / layout.safe_relpath(f.path, what="file", path=store.where(prefix))
        p.parent.mkdir(parents=True, exist_ok=True)
        os.close(os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644))
        paths[f.path] = p
        hashes[f.path] = _InOrderHash()
    futures: list[Future[None]] = []
    if store.s3 is not None:
        _stream_s3(store, prefix, files, land, workers)
    else:
        with ThreadPoolExecutor(workers, thread_name_prefix="stagerd-restore") as pool:
            for f in sorted(files, key=lambda f: -f.size):  # the big ones first: they set the wall time
                for offset in range(0, f.size, chunk_size):  # an empty file needs no read
                    window.acquire()
                    if failed.is_set():
                        window.release()
                        break
                    futures.append(pool.submit(piece, f, offset, min(chunk_size, f.size - offset)))
            wait(futures, return_when=FIRST_EXCEPTION)
            for fu in futures:
                fu.cancel()
            wait(futures)
            for fu in futures:
                if not fu.cancelled() and (exc := fu.exception()) is not None:
                    raise exc
    for f in files:
        got = hashes[f.path]
        if got.next != f.size or got.h.hexdigest() != f.sha256:
            raise RestoreError(
                f"sha256 {got.h.hexdigest()} is not the manifest's {f.sha256}: the object is corrupt",
                path=store.where(f"{prefix}/{f.path}"),
            )
        fd = os.open(paths[f.path], os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    for d in sorted({(dest / f.path).parent for f in files} | {dest}, key=lambda p: -len(p.parts)):
        layout.fsync_dir(d)


STREAM_CHUNK = 8 << 20
# cuts of one object's body survived in a row, each going on from the byte it reached; a cut a chunk or more
# after the last one starts the count again: over a link that keeps dropping, a big file still comes whole
STREAM_RETRIES = 5
STREAM_BACKOFF_S = 0.1  # doubled after each cut in a row


def _stream_s3(
    store: RemoteStore,
    prefix: str,
    files: tuple[ManifestFile, ...],
    land: Callable[[ManifestFile, int, bytes], None],
    workers: int,
) -> None:
    """S3: one streamed GET per object, `workers` objects at a time, on s3fs's event loop; each chunk is
    written and hashed in a thread (in order, as it arrives) while the loop goes on reading the others.

    One GET per object rather than ranged pieces: a ranged GET costs some stores (moto among them) a read
    of the whole object, and a raw step has one file per rank and kind to spread over the connections.
    botocore retries a request only until its answer starts: a body cut after that (a reset connection, a
    read timeout) goes on from the byte it reached, `If-Match` the ETag first read (an object replaced
    meanwhile is a `RestoreError`), up to `STREAM_RETRIES` cuts in a row, then a retryable `SinkError`;
    a cut that comes `STREAM_CHUNK` bytes or more after the last one is the first of a new row.
    """
    import asyncio

    import aiohttp
    from botocore.exceptions import BotoCoreError

    from stagerd.sinks.s3.client import error_code, precondition_failed, s3_error

    cut_errors = (aiohttp.ClientError, BotoCoreError, asyncio.TimeoutError, ConnectionError)
    backend = store.s3
    pool = ThreadPoolExecutor(workers, thread_name_prefix="stagerd-restore")

    async def one(f: ManifestFile, gate: asyncio.Semaphore) -> None:
        key = f"{prefix}/{f.path}"
        async with gate:
            s3 = await backend._client()
            loop = asyncio.get_running_loop()
            pos, etag, cuts, cut_at = 0, None, 0, 0
            while True:
                rest: dict[str, str] = {} if etag is None else {"IfMatch": etag, "Range": f"bytes={pos}-"}
                try:
                    r = await s3.get_object(Bucket=backend.bucket, Key=backend.key(key), **rest)
                except Exception as e:
                    if precondition_failed(e):
                        raise RestoreError(
                            "changed on the sink during the restore", path=store.where(key)
                        ) from None
                    if error_code(e)[0] == "NoSuchKey":  # listed at the start: deleted since
                        raise StepVanishedError(
                            "disappeared from the sink during the restore", path=store.where(key)
                        ) from None
                    raise s3_error(e, store.where(key)) from None
                etag = etag or r.get("ETag")
                cut: BaseException | None = None
                body = r["Body"]  # not `as body`: aiobotocore 2.x enters its aiohttp response
                async with body:
                    while True:
                        try:
                            chunk = await body.read(STREAM_CHUNK)
                        except cut_errors as e:
                            cut = e
                            break
                        if not chunk:
                            break
                        if pos + len(chunk) > f.size:
                            raise RestoreError(
                                f"is longer than the manifest's {f.size} bytes", path=store.where(key)
                            )
                        await loop.run_in_executor(pool, land, f, pos, chunk)
                        pos += len(chunk)
                if cut is None or pos == f.size:
                    break
                cuts = 1 if pos - cut_at >= STREAM_CHUNK else cuts + 1
                cut_at = pos
                if etag is None or cuts > STREAM_RETRIES:  # no ETag: a resumed read could mix two objects
                    raise SinkError(
                        f"the download was cut {cuts} time(s) in a row, each within {STREAM_CHUNK} bytes of "
                        f"the last, at byte {pos}: {type(cut).__name__}",
                        path=store.where(key),
                    )
                log.warning(
                    "%s: download cut at byte %d (%s); going on from there", store.where(key), pos, cut
                )
                await asyncio.sleep(min(STREAM_BACKOFF_S * 2**cuts, 5.0))
            if pos != f.size:
                raise RestoreError(f"ended after {pos} bytes, expected {f.size}", path=store.where(key))

    async def every() -> None:
        gate = asyncio.Semaphore(workers)
        async with asyncio.TaskGroup() as tg:  # the first failure cancels the rest
            for f in sorted(files, key=lambda f: -f.size):
                tg.create_task(one(f, gate))

    try:
        backend._run(every)
    except BaseExceptionGroup as eg:
        raise eg.exceptions[0] from None
    finally:
        pool.shutdown(wait=True)
