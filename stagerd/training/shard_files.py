"""One rank's files of a save, straight from the host buffers to the disk, at the disk's speed.

Each file is a safetensors file as DCP's `HuggingFaceStorageWriter(save_distributed=True)` writes it (a
header whose `__metadata__` holds `DCP_SHARDING_INFO`: every block's `saved_offsets` in its global tensor),
so the export engine and DCP's `HuggingFaceStorageReader` read it as before:

    model/shard-RRRRR-model-00001-of-00001.safetensors   this rank's model blocks (RRRRR = rank + 1)
    optim/shard-RRRRR-FFFFF.safetensors                   its optimizer blocks, in one or more files
    optim/shard-RRRRR.objects.pt                          the optimizer's other leaves (lr, betas...)

The data go out with `pwrite` from the buffers themselves (no serialization copy), in chunks spread over
a few threads, each file's blocks reserved first (`fallocate`), writeback started as each chunk lands
(`sync_file_range`) and one fsync per file once its last chunk is written; the directories are fsynced
last. A non-contiguous staged tensor is made contiguous here, off the training's stall.
"""

from __future__ import annotations

import io
import itertools
import json
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from stagerd.contract import layout
from stagerd.contract.dtypes import safetensors_name
from stagerd.contract.safetensors_format import DCP_SHARDING_INFO_KEY, SAVED_OFFSETS_KEY, encode_header
from stagerd.ops import libc
from stagerd.training.placement import Block

CHUNK = 64 << 20  # bytes per pwrite task: large enough for the disk, small enough to spread over threads
OPTIM_FILE_BYTES = 1 << 30  # optimizer state is split into files of about this size, one writer each
_HEADER_METADATA = {"DCP_VERSION": "1.0", "format": "pt"}  # what torch's HF writer records beside the offsets


def model_file(rank: int) -> str:
    return f"{layout.MODEL_DIR}/shard-{rank + 1:05d}-model-00001-of-00001.safetensors"


def optim_file(rank: int, index: int) -> str:
    return f"{layout.OPTIM_DIR}/shard-{rank + 1:05d}-{index + 1:05d}.safetensors"


def objects_file(rank: int) -> str:
    return f"{layout.OPTIM_DIR}/shard-{rank + 1:05d}.objects.pt"


@dataclass
class FileJob:
    """One file: its path relative to the step directory and its byte pieces in order."""

    rel: str
    pieces: list[memoryview] = field(default_factory=list)

    @property
    def size(self) -> int:
        return sum(p.nbytes for p in self.pieces)


def _bytes(host: torch.Tensor) -> memoryview:
    """The row-major bytes of a staged tensor: a view of its buffer when it is contiguous."""
    if host.numel() == 0:
        return memoryview(b"")
    flat = (host if host.is_contiguous() else host.contiguous()).reshape(-1)
    if flat.dtype != torch.uint8:
        flat = flat.view(torch.uint8)
    return memoryview(flat.numpy()).cast("B")  # type: ignore[arg-type]


def safetensors_job(rel: str, blocks: list[Block]) -> FileJob:
    """A safetensors file of `blocks`, with DCP's sharding info (blocks in the given order)."""
    entries: dict[str, tuple[str, tuple[int, ...], int, int]] = {}
    info: dict[str, dict[str, list[int]]] = {}
    pieces: list[memoryview] = []
    at = 0
    for b in blocks:
        data = _bytes(b.host)
        entries[b.name] = (safetensors_name(b.host.dtype), tuple(b.host.shape), at, at + data.nbytes)
        info[b.name] = {SAVED_OFFSETS_KEY: list(b.offsets)}
        pieces.append(data)
        at += data.nbytes
    header = encode_header(entries, {DCP_SHARDING_INFO_KEY: json.dumps(info), **_HEADER_METADATA})
    return FileJob(rel, [memoryview(header), *pieces])


def split_by_size(blocks: list[Block], files: int) -> list[list[Block]]:
    """`blocks` in `files` groups of about equal bytes (largest first into the lightest), order kept."""
    if files <= 1:
        return [blocks]
    load = [0] * files
    group: dict[str, int] = {}
    for b in sorted(blocks, key=lambda b: -b.host.numel() * b.host.element_size()):
        i = min(range(files), key=lambda i: (load[i], i))
        group[b.name] = i
        load[i] += b.host.numel() * b.host.element_size()
    return [[b for b in blocks if group[b.name] == i] for i in range(files)]


def objects_job(rel: str, objects: dict[str, Any]) -> FileJob:
    buf = io.BytesIO()
    torch.save(objects, buf)
    return FileJob(rel, [memoryview(buf.getvalue())])


_WRITEBACK = libc.sync_file_range()


class WriteError(Exception):
    """A file of the save could not be written: which one, and why."""

    def __init__(self, rel: str, cause: BaseException) -> None:
        super().__init__(f"{rel}: {type(cause).__name__}: {cause}")
        self.rel, self.cause = rel, cause


class _File:
    """An open output file and how many of its bytes are still to be written."""

    def __init__(self, rel: str, path: Path, size: int) -> None:
        self.rel = rel
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        self.size = self.left = size
        self.lock = threading.Lock()
        if size:
            try:
                os.posix_fallocate(self.fd, 0, size)
            except OSError as e:  # a file system without it still takes the writes
                if e.errno not in (95, 22):  # EOPNOTSUPP, EINVAL
                    os.close(self.fd)
                    raise


def _chunks(job: FileJob) -> list[tuple[int, list[memoryview]]]:
    """(file offset, pieces) tasks of at most CHUNK bytes each (a large piece is cut, small ones grouped)."""
    tasks: list[tuple[int, list[memoryview]]] = []
    at, start, cur, cur_n = 0, 0, [], 0
    for piece in job.pieces:
        pos = 0
        while pos < piece.nbytes:
            take = min(piece.nbytes - pos, CHUNK - cur_n)
            cur.append(piece[pos : pos + take])
            cur_n += take
            pos += take
            at += take
            if cur_n == CHUNK:
                tasks.append((start, cur))
                start, cur, cur_n = at, [], 0
    if cur:
        tasks.append((start, cur))
    return tasks


def _pwrite_all(fd: int, pieces: list[memoryview], offset: int) -> None:
    for piece in pieces:
        done = 0
        while done < piece.nbytes:
            done += os.pwrite(fd, piece[done:], offset + done)
        offset += piece.nbytes


class ShardWriter:
    """Writes a save's files on `threads` threads; reused from save to save."""

    def __init__(self, threads: int) -> None:
        self.threads = max(1, threads)
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="stagerd-write")

    def write(self, step_dir: Path, jobs: list[FileJob]) -> dict[str, int]:
        """Write every job durably (fsync per file, then the directories); {relative path: size}."""
        dirs = sorted({(step_dir / j.rel).parent for j in jobs})
        for d in dirs:
            d.mkdir(parents=True, exist_ok=True)
        files: list[_File] = []
        futures: list[Future[None]] = []
        try:
            per_file = []
            for job in jobs:
                try:
                    f = _File(job.rel, step_dir / job.rel, job.size)
                except OSError as e:
                    raise WriteError(job.rel, e) from None
                files.append(f)
                per_file.append([(f, off, pieces) for off, pieces in _chunks(job)])
            # The files' chunks interleaved: each thread works on another file (a file system serializes
            # buffered writes to one file), and every file is written front to back.
            tasks = [t for group in itertools.zip_longest(*per_file) for t in group if t is not None]
            for f, off, pieces in tasks:
                futures.append(self._pool.submit(self._task, f, off, pieces))
            for f in files:
                if f.size == 0:  # an empty file gets no task: fsync it here
                    os.fsync(f.fd)
            for (f, _, _), fut in zip(tasks, futures, strict=True):
                if (failure := fut.exception()) is not None:
                    raise WriteError(f.rel, failure)
        finally:
            # After a failure, chunks still queued or running would write through descriptors closed here,
            # whose numbers the process may already have given to other files: none may outlive them.
            for fut in futures:
                fut.cancel()
            wait(futures)
            for f in files:
                os.close(f.fd)
        for d in dirs:
            layout.fsync_dir(d)
        return {j.rel: j.size for j in jobs}

    def _task(self, f: _File, offset: int, pieces: list[memoryview]) -> None:
        _pwrite_all(f.fd, pieces, offset)
        n = sum(p.nbytes for p in pieces)
        if _WRITEBACK is not None:
            _WRITEBACK(f.fd, offset, n, libc.SYNC_FILE_RANGE_WRITE)  # a hint: errors surface in fsync
        with f.lock:
            f.left -= n
            last = f.left == 0
        if last:
            os.fsync(f.fd)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
