"""The training-side library: `Stager`, an async DCP save into node-local staging with a commit marker.

    stager = Stager(root="/local_nvme/ckpt")          # every rank, after init_process_group
    handle = stager.save(model_sd, step=100, extras={"config.json": cfg}, dtype="bf16",
                         optimizer_state=optim_sd)
    stager.wait_staged()   # before the next optimizer step mutates the parameters
    stager.wait()          # before exit: every save durable and committed (raises SaveError on failure)
    stager.close()

How a save runs
---------------
`save()` starts the device-to-host copy, then, while it runs, checks the arguments and the step and agrees
with the other ranks (one small gloo all_reduce) before anything is written; `wait_staged()` blocks until
the copy is done. Everything else runs behind it, on a committer thread: once every rank's copy is done
(an agreement), `dcp.async_save` writes this rank's `model/` shard with
`HuggingFaceStorageWriter(save_distributed=True)`, then the optimizer state goes to `optim/` in DCP's own
format (`FileSystemWriter`), rank 0 writes `extras/`, the ranks agree that all of it succeeded, and only
then the commit marker is written (and the ranks agree once more that it was).

Staging uses one `DefaultStager` per kind of state (model, optimizer) for the Stager's life. Its
`StateDictStager` caches a host buffer per source storage, so from the second save on nothing is
allocated: the copy goes into the same buffers. Pass state dicts whose tensors alias the live
parameters (`model.state_dict()` under FSDP2 does); a dict of fresh tensors each step defeats the cache.
The stager is handed each DTensor's local tensor, never the DTensor (torch's stager cannot copy a DTensor
whose local tensor starts at a storage offset, and would deep-copy its mesh every save); the DTensors are
rebuilt around the host copies afterwards. Views of one storage (FSDP2's flat buffers, fused QKV splits)
share one host buffer the size of that storage, and a tensor under two keys (tied weights) is copied
once. A non-contiguous tensor is made contiguous after the copy, off the stall (safetensors is
row-major), which allocates per save for that tensor only.

Failures
--------
Whatever fails on one rank, every rank's handle and `wait()` raise the same `SaveError`, naming the
failing rank and the cause, and no marker is written. No rank is ever left waiting in a collective that
another rank skipped: after `save()`'s agreement, each rank runs the same sequence (staging agreement,
DCP's model write, an agreement before the optimizer's write when there is one, the write agreement, the
commit agreement), and a rank's failure is carried to the next agreement instead of skipping ahead. A
failure before the write (the host copy, clearing a stale step directory, starting DCP) stops every
rank before DCP's collectives; DCP itself reports a failure during the write on every rank; a failure
after it (extras, the marker) fails the write or commit agreement. A rank that dies, or a group whose
`timeout` runs out, fails the save on the ranks that notice ("lost contact"), which then keep no marker.
With CUDA the buffers are pinned and the copies non-blocking on a side stream that first waits for the
current stream (construct the Stager after `torch.cuda.set_device`: the side stream lives on the current
device); without CUDA they are plain host memory copied on a background thread.

Checkpointer types: `"thread"` runs the write in a thread of the training process; `"process"` runs it in
torch's checkpoint daemon process (buffers then live in shared memory), which keeps serialization and
fsync off the training process's GIL. Default: `"process"` with CUDA, `"thread"` without (no extra
process, no shared memory, nothing to spawn on a CPU box).

Only one save is in flight at a time: a `save()` issued while the previous one is still writing waits for
it first (and logs how long), because both would run collectives on the same group. The Stager owns a
gloo process group of its own, so its background collectives never interleave with the training's.

The commit marker
-----------------
Each rank's writer stats the files it wrote (after torch fsynced them) and fsyncs their directory; the
sizes travel inside the DCP write results, which DCP gathers on the coordinator, where `finish()` runs
only after every rank wrote. The gathered list comes back to every rank in the returned `Metadata`.
The marker lists exactly those files (model/, optim/, extras/), never a directory listing, plus
`tensors` (global dtype and shape of every model tensor, from DCP's global metadata) and `world_size`.
It is written atomically (temp name, fsync, rename, directory fsync), after an all-ranks agreement that
every part of the save succeeded. A failed save never writes a marker, and raises `SaveError` from
`handle.result()` and from `wait()`. A step whose directory already has a marker is refused with
`StepExistsError` on every rank. A step directory without a marker is a crashed, uncommitted save: its
`model/`, `optim/` and `extras/` are removed before the new save writes.

Multi-node rules
----------------
At construction the ranks find out how `root` is shared: every node's first rank drops a probe file into
`root` and every rank reports which probes it sees (nodes are told apart by `$STAGERD_NODE_ID`, else the
host name).

1. Shared root (every rank sees every probe: one node, or a shared filesystem): global rank 0 writes the
   single marker, listing every rank's files. `staging_node=0`, `staging_nodes=1`.
2. Node-local root (each rank sees exactly its own node's probe): each node's local rank 0 (the lowest
   global rank on that node) writes its node's marker once the whole save has completed on every rank.
   It lists only the files written by that node's ranks, with `staging_node=k`, `staging_nodes=N`
   (nodes numbered by their lowest global rank). `world_size` and `tensors` stay global. Extras and the
   optimizer's DCP `.metadata` are written by global rank 0, so they are on node 0 only. The step is
   whole only once all N node markers exist; one node's shards alone do not tile the model, and the
   export engine refuses them (the marker's global `tensors` reveals the gap).
3. Anything else (some ranks of a node see a different root) is a `ConfigError` at construction.
4. Every rank must call `Stager(...)`, `save()` with the same step (and all or none of them with
   `optimizer_state`), and `close()`. `extras`, `reference_index`, `dtype` and `metadata` are taken from
   rank 0 alone, for every node's marker; other ranks may pass them or not.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import errno
import json
import logging
import os
import shutil
import socket
import threading
import time
import traceback
import uuid
import warnings
import weakref
from collections.abc import Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter, HuggingFaceStorageWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, AsyncSaveResponse
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.checkpoint.storage import WriteResult
from torch.distributed.tensor import DTensor

from stagerd.contract import layout
from stagerd.contract.dtypes import parse_export_dtype, safetensors_name
from stagerd.errors import (
    ConfigError,
    ReferenceIndexError,
    SaveError,
    SaveInputError,
    StagerdError,
    StepExistsError,
)

__all__ = ["SaveHandle", "Stager", "StagingTopology"]

log = logging.getLogger("stagerd.stage")

_PROBE_PREFIX = ".stagerd-probe-"
# --dtype spellings the export engine takes, by safetensors name.
_DTYPE_HINT = {None: "keep", "BF16": "bf16", "F16": "fp16", "F32": "fp32"}


# ----------------------------------------------------------------------------------------------------
# Writers: DCP storage writers that report the size of every file they wrote.


@dataclass(frozen=True)
class _Written:
    """A write result's storage data, annotated with the file it went to (relative to the step dir)."""

    inner: Any
    file: str
    size: int
    rank: int


@dataclass(frozen=True)
class StagedFiles:
    """What every rank wrote: (path relative to the step dir, size, writing rank). Rides in Metadata."""

    files: tuple[tuple[str, int, int], ...]


def _annotate(results: list[WriteResult], directory: Path, subdir: str, rank: int) -> list[WriteResult]:
    """Stat the files behind `results`, fsync their directory, and attach (file, size, rank) to each."""
    sizes: dict[str, int] = {}
    for wr in results:
        rel = wr.storage_data.relative_path
        if rel not in sizes:
            sizes[rel] = os.stat(directory / rel).st_size
    if sizes:
        layout.fsync_dir(directory)
    out = []
    for wr in results:
        rel = wr.storage_data.relative_path
        out.append(
            dataclasses.replace(
                wr, storage_data=_Written(wr.storage_data, f"{subdir}/{rel}", sizes[rel], rank)
            )
        )
    return out


def _unwrap(results: list[list[WriteResult]]) -> tuple[list[list[WriteResult]], dict[str, tuple[int, int]]]:
    """Strip the annotations again (torch pickles storage_data into its own metadata); collect the files."""
    files: dict[str, tuple[int, int]] = {}
    plain = []
    for per_rank in results:
        out = []
        for wr in per_rank:
            w = wr.storage_data
            if not isinstance(w, _Written):
                raise AssertionError(f"write result without stagerd annotation: {wr}")
            seen = files.setdefault(w.file, (w.size, w.rank))
            if seen != (w.size, w.rank):
                raise SaveError(f"{w.file} reported by ranks {seen[1]} and {w.rank}")
            out.append(dataclasses.replace(wr, storage_data=w.inner))
        plain.append(out)
    return plain, files


def _staged_files(files: dict[str, tuple[int, int]]) -> StagedFiles:
    return StagedFiles(tuple(sorted((p, s, r) for p, (s, r) in files.items())))


class _ModelWriter(HuggingFaceStorageWriter):
    """HF safetensors shards, one per rank (`save_distributed=True`), sizes reported to the coordinator."""

    def __init__(self, path: str) -> None:
        super().__init__(path, save_distributed=True)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> torch.futures.Future[list[WriteResult]]:
        results = super().write_data(plan, planner).wait()
        fut: torch.futures.Future[list[WriteResult]] = torch.futures.Future()
        fut.set_result(_annotate(results, Path(self.path), layout.MODEL_DIR, self.rank or 0))
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        plain, files = _unwrap(results)
        super().finish(metadata, plain)
        # Runs on the coordinator after every rank wrote; DCP broadcasts `metadata` back to all ranks.
        metadata.storage_data = _staged_files(files)


class _OptimWriter(FileSystemWriter):
    """Optimizer state in DCP's own format, sizes reported like the model's (plus `.metadata`)."""

    def __init__(self, path: str) -> None:
        super().__init__(path, overwrite=True)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> torch.futures.Future[list[WriteResult]]:
        results = super().write_data(plan, planner).wait()
        fut: torch.futures.Future[list[WriteResult]] = torch.futures.Future()
        fut.set_result(_annotate(results, Path(self.path), layout.OPTIM_DIR, self.rank or 0))
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        plain, files = _unwrap(results)
        super().finish(metadata, plain)  # pickles metadata (with torch's own storage_data) to .metadata
        directory = Path(self.path)
        layout.fsync_dir(directory)
        files[f"{layout.OPTIM_DIR}/.metadata"] = ((directory / ".metadata").stat().st_size, self.rank or 0)
        metadata.storage_data = _staged_files(files)


class _AlreadyStaged:
    """An AsyncStager handing `async_save` a staging the Stager already started (a Future) or finished."""

    _synchronize_after_execute = False
    should_synchronize_after_execute = False

    def __init__(self, staged: Any) -> None:
        self._staged = staged

    def stage(self, state_dict: Any) -> Any:
        return self._staged

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


# ----------------------------------------------------------------------------------------------------
# Collectives on the Stager's own group; trivial without torch.distributed.


class _Comm:
    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self.rank = dist.get_rank(group) if group is not None else 0
        self.world = dist.get_world_size(group) if group is not None else 1

    def all_gather(self, obj: Any) -> list[Any]:
        if self.group is None:
            return [obj]
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def sum(self, values: list[int]) -> list[int]:
        if self.group is None:
            return list(values)
        t = torch.tensor([int(v) for v in values], dtype=torch.int64)
        dist.all_reduce(t, group=self.group)
        return t.tolist()

    def broadcast(self, obj: Any) -> Any:
        if self.group is None:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, 0), group=self.group)
        return box[0]


@dataclass(frozen=True)
class StagingTopology:
    """How the staging root is shared between the ranks (see the module docstring's multi-node rules)."""

    shared: bool
    node_of_rank: tuple[int, ...]  # staging node index of every rank (all 0 when shared)
    num_nodes: int  # staging nodes: 1 when shared

    def leader(self, node: int) -> int:
        return self.node_of_rank.index(node)

    def node(self, rank: int) -> int:
        return self.node_of_rank[rank]


def _discover(root: Path, comm: _Comm, node_key: str) -> StagingTopology:
    """Probe which ranks see the same `root` (four small collectives, once, at construction)."""
    keys = comm.all_gather(node_key)
    order: list[str] = []
    for k in keys:
        if k not in order:
            order.append(k)
    host_node = tuple(order.index(k) for k in keys)
    me = host_node[comm.rank]
    token = comm.broadcast(uuid.uuid4().hex if comm.rank == 0 else None)
    probe = root / f"{_PROBE_PREFIX}{token}-{me}"
    is_leader = host_node.index(me) == comm.rank
    if is_leader:
        layout.write_bytes_atomic(probe, b"")
    comm.all_gather(None)  # every leader's probe exists before anyone looks
    prefix = f"{_PROBE_PREFIX}{token}-"
    seen = sorted(int(p.name[len(prefix) :]) for p in root.glob(f"{prefix}*"))
    all_seen = comm.all_gather(seen)  # everyone has looked before a leader removes its probe
    if is_leader:
        probe.unlink()
    everything = list(range(len(order)))
    if all(s == everything for s in all_seen):
        return StagingTopology(True, (0,) * comm.world, 1)
    if all(s == [host_node[r]] for r, s in enumerate(all_seen)):
        return StagingTopology(False, host_node, len(order))
    raise ConfigError(
        f"staging root {root} is shared by some nodes but not others (probes seen per rank: {all_seen})",
        path=root,
        hint="give every node its own local root, or put the root on one filesystem that all ranks share",
    )


# ----------------------------------------------------------------------------------------------------
# Inputs of one save, checked and snapshotted before anything is written.


@dataclass(frozen=True)
class _Extra:
    name: str
    data: bytes | None  # JSON or raw bytes, snapshotted at save()
    source: Path | None  # a file copied at commit time


@dataclass(frozen=True)
class _SaveSpec:
    step: int
    step_dir: Path
    extras: tuple[_Extra, ...] = ()
    reference_index: dict[str, str] | str | None = None
    dtype: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)


def _resolve_stateful(sd: Any, what: str) -> dict[str, Any]:
    if not isinstance(sd, Mapping):
        raise SaveInputError(f"{what} must be a mapping of names to tensors, got {type(sd).__name__}")
    # The tensor test first: the Stateful protocol check is slow, and this runs inside the stall.
    return {
        k: v if isinstance(v, torch.Tensor) or not isinstance(v, Stateful) else v.state_dict()
        for k, v in sd.items()
    }


def _check_tensors(sd: Mapping[str, Any], prefix: str = "") -> int:
    """Every leaf of the model state dict is a tensor (the HF writer cannot store anything else)."""
    n = 0
    for k, v in sd.items():
        name = f"{prefix}{k}"
        if not isinstance(k, str):
            raise SaveInputError(f"state dict key {name!r} is not a string")
        if isinstance(v, torch.Tensor):
            if v.is_meta:
                raise SaveInputError(
                    f"model state dict entry {name!r} is a meta tensor (never materialized): it has no data"
                )
            n += 1
        elif isinstance(v, Mapping):
            n += _check_tensors(v, f"{name}.")
        else:
            raise SaveInputError(
                f"model state dict entry {name!r} is a {type(v).__name__}, not a tensor; "
                "put non-tensor state in optimizer_state or extras"
            )
    return n


def _locals(obj: Any, wrappers: list[DTensor | None]) -> Any:
    """The state dict with every DTensor replaced by its local tensor; `wrappers` gets, per tensor leaf
    in traversal order, its DTensor or None (containers are rebuilt, so later edits cannot disturb it).

    torch's StateDictStager mistakes a DTensor whose local tensor starts at a non-zero storage offset for
    a tensor with storage of its own (the wrapper reports a non-zero data_ptr) and fails in copy_(); it
    also deep-copies each DTensor's DeviceMesh on every save. Plain local tensors avoid both: views of
    one storage share one staging buffer, a tensor under two keys is staged once.
    """
    if isinstance(obj, torch.Tensor):
        if isinstance(obj, DTensor):
            wrappers.append(obj)
            return obj._local_tensor  # to_local() would add an autograd node per tensor inside the stall
        wrappers.append(None)
        return obj
    if isinstance(obj, Mapping):
        return {k: _locals(v, wrappers) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        out = [_locals(v, wrappers) for v in obj]
        return out if isinstance(obj, list) else tuple(out)
    return obj


def _rewrap(staged: Any, wrappers: Iterator[DTensor | None], memo: dict[tuple[int, int], Any]) -> Any:
    """Put the DTensors back around their staged local tensors (the inverse of `_locals`).

    A non-contiguous staged tensor (a transposed view, say) is made contiguous here, on the committer
    thread, because safetensors stores row-major bytes only; that copy is the one allocation per save
    such a tensor costs, and it stays off the training stall.
    """
    if isinstance(staged, torch.Tensor):
        orig = next(wrappers)
        key = (id(orig), id(staged))
        if key not in memo:  # a tensor under two keys stays one object
            local = staged if staged.is_contiguous() else staged.contiguous()
            # DTensor's own constructor with the original spec (mesh, placements, global shape and
            # stride): 3 us a tensor against 25-65 us for from_local's autograd path, on a thread that
            # DCP's write waits for.
            memo[key] = local if orig is None else DTensor(local, orig._spec, requires_grad=False)
        return memo[key]
    if isinstance(staged, dict):
        return {k: _rewrap(v, wrappers, memo) for k, v in staged.items()}
    if isinstance(staged, list | tuple):
        out = [_rewrap(v, wrappers, memo) for v in staged]
        return out if isinstance(staged, list) else tuple(out)
    return staged


@dataclass
class _Staging:
    """One state dict's host copy in flight: the DefaultStager's future and how to re-wrap its result."""

    future: Future
    wrappers: list[DTensor | None]

    def result(self) -> Any:
        staged = self.future.result()
        with torch.no_grad():
            return _rewrap(staged, iter(self.wrappers), {})


def _snapshot_extras(extras: Mapping[str, Any] | None) -> tuple[_Extra, ...]:
    out = []
    for name, value in (extras or {}).items():
        try:
            layout.safe_relpath(name, what="extras name", path=None)
        except StagerdError as e:
            raise SaveInputError(e.message) from None
        if isinstance(value, Mapping | list):
            try:
                data = (json.dumps(value, indent=2) + "\n").encode()
            except (TypeError, ValueError) as e:
                raise SaveInputError(f"extras {name!r} is not JSON-serializable: {e}") from None
            out.append(_Extra(name, data, None))
        elif isinstance(value, bytes | bytearray | memoryview):
            out.append(_Extra(name, bytes(value), None))
        elif isinstance(value, str | os.PathLike):
            src = Path(value)
            if not src.is_file():
                raise SaveInputError(f"extras {name!r}: {src} is not a readable file", path=src)
            out.append(_Extra(name, None, src.resolve()))
        else:
            kind = type(value).__name__
            raise SaveInputError(f"extras {name!r} must be a dict, bytes or a file path, not {kind}")
    return tuple(out)


def _check_reference_index(ref: Any) -> dict[str, str] | str | None:
    if ref is None:
        return None
    if isinstance(ref, str | os.PathLike):
        p = Path(ref)
        if not p.is_file():
            raise ReferenceIndexError("reference index not found", path=p)
        return str(p.resolve())
    if isinstance(ref, Mapping):
        wm = ref.get("weight_map", ref)
        if isinstance(wm, Mapping) and all(isinstance(k, str) and isinstance(v, str) for k, v in wm.items()):
            return dict(wm)
    raise ReferenceIndexError("reference_index must be a path or a weight_map {tensor name: file name}")


def _write_extras(step_dir: Path, extras: tuple[_Extra, ...]) -> dict[str, tuple[int, int]]:
    """Rank 0: write extras/ durably (temp name, fsync, rename, directory fsync)."""
    out: dict[str, tuple[int, int]] = {}
    for e in extras:
        dst = step_dir / layout.EXTRAS_DIR / e.name
        dst.parent.mkdir(parents=True, exist_ok=True)
        if e.data is not None:
            layout.write_bytes_atomic(dst, e.data)
        else:
            assert e.source is not None
            tmp = dst.with_name(f".{dst.name}.tmp-{os.getpid()}")
            with open(e.source, "rb") as fin, open(tmp, "wb") as fout:
                shutil.copyfileobj(fin, fout, 1 << 20)
                fout.flush()
                os.fsync(fout.fileno())
            os.replace(tmp, dst)
            layout.fsync_dir(dst.parent)
        out[f"{layout.EXTRAS_DIR}/{e.name}"] = (dst.stat().st_size, 0)
    if extras:
        layout.fsync_dir(step_dir)
    return out


def _tensor_infos(meta: Metadata) -> dict[str, layout.TensorInfo]:
    out = {}
    for fqn, md in meta.state_dict_metadata.items():
        if not isinstance(md, TensorStorageMetadata):
            raise SaveError(f"model state dict entry {fqn!r} is not a tensor")
        out[fqn] = layout.TensorInfo(safetensors_name(md.properties.dtype), tuple(int(x) for x in md.size))
    return out


def _causes(exc: BaseException) -> list[tuple[str, BaseException]]:
    """(where, exception) of every rank failure inside a DCP CheckpointException, or the exception itself."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        return [
            (f"rank {rank}", wrapped[0] if isinstance(wrapped, tuple) else wrapped)
            for rank, wrapped in sorted(failures.items())
        ]
    return [("", exc)]


def _describe(exc: BaseException) -> str:
    """One line naming each failing rank and its error."""
    return "; ".join(f"{where + ': ' if where else ''}{type(e).__name__}: {e}" for where, e in _causes(exc))


def _disk_full(exc: BaseException) -> bool:
    return any(isinstance(e, OSError) and e.errno in _DISK_FULL for _, e in _causes(exc))


_DISK_FULL = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}


@dataclass(frozen=True)
class _Failure:
    """What went wrong on one rank, as it travels to the others in an agreement (one line)."""

    text: str
    disk_full: bool = False

    @classmethod
    def of(cls, doing: str, exc: BaseException) -> _Failure:
        return cls(f"{doing} failed: {_describe(exc)}", _disk_full(exc))


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def _settle(staging: list[_Staging]) -> None:
    """Wait for host copies that still read the caller's tensors, whatever their outcome."""
    for st in staging:
        with contextlib.suppress(Exception):
            st.future.result()


# ----------------------------------------------------------------------------------------------------
# The handle and the Stager.


@dataclass
class SaveHandle:
    """One save in flight. `result()` returns the commit marker of this rank's node, or raises SaveError."""

    step: int
    step_dir: Path
    staging: tuple[Future, ...]
    committed: Future = field(repr=False)

    def staged(self) -> bool:
        return all(f.done() for f in self.staging)

    def wait_staged(self, timeout: float | None = None) -> None:
        """Block until the host copy is complete; the source tensors may then change."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for f in self.staging:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                f.result(left)
            except TimeoutError:
                raise
            except (Exception, CheckpointException) as e:
                raise SaveError(
                    f"step {self.step}: staging the state dict failed: {_describe(e)}", path=self.step_dir
                ) from e

    def done(self) -> bool:
        return self.committed.done()

    def result(self, timeout: float | None = None) -> layout.CommitMarker:
        committed = self.committed
        try:
            return committed.result(timeout)
        finally:  # as Future.result does: the raised error's traceback must not lead back to the future
            del self, committed

    def exception(self, timeout: float | None = None) -> BaseException | None:
        return self.committed.exception(timeout)


def _default_checkpointer() -> AsyncCheckpointerType:
    return AsyncCheckpointerType.PROCESS if torch.cuda.is_available() else AsyncCheckpointerType.THREAD


def _outcomes(handles: list[SaveHandle]) -> tuple[list[layout.CommitMarker], list[BaseException]]:
    markers: list[layout.CommitMarker] = []
    errors: list[BaseException] = []
    for handle in handles:
        try:
            markers.append(handle.result())
        except Exception as e:
            # Its traceback would hold this frame, whose locals hold the handles and this list, which
            # hold the error: a cycle. wait() raises it again with a traceback of its own.
            errors.append(e.with_traceback(None))
    return markers, errors


def _clear_frames(exc: BaseException) -> None:
    """Drop the locals of every frame in `exc`'s tracebacks, its causes' and DCP's per-rank failures'."""
    pending: list[BaseException] = [exc]
    seen: set[int] = set()
    while pending:
        error = pending.pop()
        if id(error) in seen:
            continue
        seen.add(id(error))
        traceback.clear_frames(error.__traceback__)
        pending.extend(e for e in (error.__cause__, error.__context__) if e is not None)
        if isinstance(error, CheckpointException):
            for failure in error.failures.values():
                inner = failure[0] if isinstance(failure, tuple) else failure
                if isinstance(inner, BaseException):
                    pending.append(inner)


def _stop_checkpoint_process() -> None:
    """Stop DCP's background checkpoint process (the 'process' checkpointer), held by a module global."""
    from torch.distributed.checkpoint import _async_process_executor as executor

    process, executor._CHECKPOINT_PROCESS = executor._CHECKPOINT_PROCESS, None
    del process  # its __del__ sends TERMINATE and joins it


# Stagers not yet closed: a process that forgets close() is closed at exit, while threads may still run.
_OPEN_STAGERS: weakref.WeakSet[Stager] = weakref.WeakSet()


# How long the exit hook lets gloo's worker threads finish what they hold (see _at_exit).
_EXIT_GRACE_SECONDS = 0.05
_used_gloo = False


@atexit.register
def _at_exit() -> None:
    for stager in list(_OPEN_STAGERS):
        try:
            stager.close()
        except Exception as e:  # its saves failed; their handles reported it; never block the exit
            log.error("closing the Stager at exit: %s", e)
            stager._release()
    if _used_gloo:
        # A gloo worker thread frees a finished collective's tensors after the caller has returned, and
        # that needs the GIL. A DeviceMesh keeps the default group (and those threads) alive past
        # destroy_process_group(), so the free can land after the interpreter started finalizing; on
        # Python 3.11 the thread is then exited by pthread_exit inside a noexcept C++ destructor:
        # std::terminate, SIGABRT. Sleeping releases the GIL so that pending frees happen now.
        time.sleep(_EXIT_GRACE_SECONDS)


class Stager:
    """Async DCP saves into `root/step-XXXXXXXX/`, committed by `stagerd.commit.json`. One per process."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        process_group: dist.ProcessGroup | None = None,
        checkpointer: str | AsyncCheckpointerType | None = None,
        pin_memory: bool | None = None,
        timeout: float | None = None,
    ) -> None:
        """`timeout` (seconds) bounds each collective of the Stager's own gloo group, DCP's included, so
        it must exceed the slowest rank's write; default: torch's default for the group (30 min)."""
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        if checkpointer is None:
            self.checkpointer = _default_checkpointer()
        else:
            try:
                self.checkpointer = AsyncCheckpointerType(checkpointer)
            except ValueError:
                raise ConfigError(f"checkpointer must be 'thread' or 'process': {checkpointer!r}") from None
        self._distributed = dist.is_available() and dist.is_initialized()
        if self._distributed:
            base = process_group or dist.group.WORLD
            # A gloo group of our own: DCP needs a CPU backend, and background collectives must not
            # interleave with the training's on the same group.
            global _used_gloo
            _used_gloo = True
            self._group: dist.ProcessGroup | None = dist.new_group(
                ranks=dist.get_process_group_ranks(base),
                backend="gloo",
                use_local_synchronization=process_group is not None,  # only its members construct a Stager
                timeout=None if timeout is None else timedelta(seconds=timeout),
            )
        else:
            if self.checkpointer is AsyncCheckpointerType.PROCESS:
                raise ConfigError("the 'process' checkpointer needs torch.distributed to be initialized")
            self._group = None
            # DCP says so on every save; single-process saving is what was asked for here.
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        self._comm = _Comm(self._group)
        self.rank, self.world_size = self._comm.rank, self._comm.world
        node_key = os.environ.get("STAGERD_NODE_ID") or socket.gethostname()
        self.topology = _discover(self.root, self._comm, node_key)
        self._node = self.topology.node(self.rank)
        self._is_leader = self.topology.leader(self._node) == self.rank

        cuda = torch.cuda.is_available()
        self.pin_memory = cuda if pin_memory is None else pin_memory
        options = StagingOptions(
            use_pinned_memory=self.pin_memory,
            use_shared_memory=self.checkpointer is AsyncCheckpointerType.PROCESS,
            use_async_staging=True,
            use_non_blocking_copy=cuda,
        )
        self._model_stager = DefaultStager(options)
        self._optim_stager = DefaultStager(options)
        self._committer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stagerd-commit")
        self._inflight: SaveHandle | None = None
        self._unreported: list[SaveHandle] = []
        self._lock = threading.Lock()
        self._closed = False
        _OPEN_STAGERS.add(self)

    # -- public API --------------------------------------------------------------------------------

    def save(
        self,
        state_dict: Mapping[str, Any],
        step: int,
        *,
        extras: Mapping[str, Any] | None = None,
        reference_index: str | os.PathLike[str] | Mapping[str, Any] | None = None,
        dtype: str | None = None,
        optimizer_state: Mapping[str, Any] | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> SaveHandle:
        """Start saving `state_dict` as `step`; returns once the host copy has been started.

        Collective: every rank calls it with the same step. Raises StepExistsError if the step is already
        committed, SaveInputError / DTypeError / ReferenceIndexError for bad arguments (on every rank).
        """
        if self._closed:
            raise SaveError("the Stager is closed")
        self._wait_previous(step)
        error: StagerdError | None = None
        spec = optim_sd = None
        staging: list[_Staging] = []
        try:
            model_sd, optim_sd = self._resolve(state_dict, step, optimizer_state)
            # Start the host copy first: the checks and the agreement below then overlap it. Nothing is
            # written to disk before the agreement; a refused save only filled our own staging buffers.
            self._order_after_compute()
            staging.append(self._stage(self._model_stager, model_sd))
            if optim_sd is not None:
                staging.append(self._stage(self._optim_stager, optim_sd))
            spec = self._describe(step, extras, reference_index, dtype, metadata)
            if self._is_leader and layout.is_committed(spec.step_dir):
                raise StepExistsError(
                    "step is already committed; refusing to overwrite it", path=spec.step_dir
                )
        except StagerdError as e:
            error = e
        except Exception as e:  # anything unexpected must still reach the agreement below, or ranks hang
            error = SaveInputError(f"cannot save step {step!r}: {type(e).__name__}: {e}")
        # Agree before anything is written: a refusal on one rank is a refusal on all. One small all_reduce
        # on the common path (this is inside the training stall); the details only when something is off.
        try:
            refused, with_optim = self._comm.sum([error is not None, optim_sd is not None])
        except Exception as e:  # a rank died or the group timed out
            _settle(staging)
            raise SaveError(f"step {step}: lost contact with the other ranks: {type(e).__name__}: {e}") from e
        if refused or 0 < with_optim < self.world_size:
            _settle(staging)
            statuses = self._comm.all_gather(
                (None if error is None else (error.name, str(error)), optim_sd is not None)
            )
            if error is not None:
                # `raise error` from the frame that holds `error` would make a cycle (error -> traceback
                # -> this frame -> error) keeping the caller's state dict, its mesh and process groups
                # alive until the cyclic collector runs, possibly only at interpreter exit (see _release).
                try:
                    raise error
                finally:
                    error = None
            for rank, (status, _) in enumerate(statuses):
                if status is not None:
                    cls = StepExistsError if status[0] == "StepExistsError" else SaveInputError
                    raise cls(f"rank {rank} refused the save of step {step}: {status[0]}: {status[1]}")
            ranks = [r for r, (_, has_optim) in enumerate(statuses) if has_optim]
            raise SaveInputError(f"step {step}: only ranks {ranks} passed optimizer_state; pass it on all")
        # From here on a failure on one rank must not leave the others waiting in a collective it never
        # enters: it is carried into the committer's agreements, which every rank reaches.
        early: _Failure | None = None
        if self._is_leader:
            try:  # before any rank writes: the writes wait for the committer's staging agreement
                self._clear_stale(spec.step_dir)
            except Exception as e:
                early = _Failure.of(f"clearing an uncommitted earlier save of {spec.step_dir.name}", e)
        return self._launch(spec, staging, early)

    def wait_staged(self, timeout: float | None = None) -> None:
        """Block until the latest save's host copy is complete (call before the next optimizer step)."""
        h = self._inflight
        if h is not None:
            h.wait_staged(timeout)

    def wait(self) -> list[layout.CommitMarker]:
        """Block until every save is durable and committed. Raises SaveError if any failed since last wait."""
        with self._lock:
            handles, self._unreported = self._unreported, []
        markers, errors = _outcomes(handles)
        del handles
        if not errors:
            return markers
        for extra in errors[1:]:
            log.error("another save failed too: %s", extra)
        first, errors = errors[0], []
        try:
            raise first
        finally:  # no cycle through this frame's locals (see the refusal in save())
            del first

    def close(self) -> None:
        """Wait for pending saves, then release the staging buffers, threads and process group.

        Afterwards nothing the Stager started is running, and nothing it holds keeps the caller's
        tensors or process groups alive (see `_release`).
        """
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._release()

    def _release(self) -> None:
        # The committer may still be inside a collective of our group, so it stops first and the group last.
        self._closed = True
        _OPEN_STAGERS.discard(self)
        self._committer.shutdown(wait=True)
        self._model_stager.close()
        self._optim_stager.close()
        # DCP's thread checkpointer starts one executor per save and shuts it down without waiting.
        for thread in threading.enumerate():
            if thread.name.startswith("AsyncCheckpointExecutor") and thread is not threading.current_thread():
                thread.join(timeout=60)
        # A failed save's exception holds the committer's frames, and through them this Stager, the
        # caller's state dict, its DeviceMesh and process groups: a reference cycle that only the
        # interpreter's last collection would free. gloo's worker threads then run C++ destructors that
        # need the GIL while the interpreter finalizes, and the process dies with SIGABRT ("terminate
        # called without an active exception"). Dropping the handles breaks the cycle now.
        self._inflight = None
        self._unreported = []
        if self.checkpointer is AsyncCheckpointerType.PROCESS:
            _stop_checkpoint_process()
        if self._group is not None:
            with contextlib.suppress(Exception):  # already destroyed by destroy_process_group()
                dist.destroy_process_group(self._group)
            self._group = None
            self._comm.group = None

    def __enter__(self) -> Stager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def staging_buffers(self) -> dict[int, int]:
        """data_ptr -> bytes of each cached host staging buffer (model and optimizer); for tests, benches."""
        out = {}
        for stager in (self._model_stager, self._optim_stager):
            for storage in stager._state_dict_stager._cached_storage_mapping.values():
                out[storage.data_ptr()] = storage.nbytes()
        return out

    def step_dir(self, step: int) -> Path:
        return self.root / layout.step_dir_name(step)

    # -- internals ---------------------------------------------------------------------------------

    def _wait_previous(self, step: int) -> None:
        h = self._inflight
        if h is None or h.done():
            return
        t0 = time.monotonic()
        with contextlib.suppress(Exception):  # its failure is reported by its handle and by wait()
            h.committed.result()
        log.warning(
            "save of step %d waited %.2f s for step %d to finish writing; save less often or write faster",
            step,
            time.monotonic() - t0,
            h.step,
        )

    def _resolve(self, state_dict, step, optimizer_state) -> tuple[dict[str, Any], dict[str, Any] | None]:
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise SaveInputError(f"step must be a non-negative integer, got {step!r}")
        model_sd = _resolve_stateful(state_dict, "state_dict")
        if _check_tensors(model_sd) == 0:
            raise SaveInputError("the model state dict holds no tensors")
        optim_sd = None if optimizer_state is None else _resolve_stateful(optimizer_state, "optimizer_state")
        return model_sd, optim_sd

    def _describe(self, step, extras, reference_index, dtype, metadata) -> _SaveSpec:
        spec = _SaveSpec(step=step, step_dir=self.step_dir(step))
        if self.rank == 0:  # the other ranks' extras, reference_index, dtype and metadata are ignored
            try:
                json.dumps(dict(metadata or {}))
            except (TypeError, ValueError) as e:
                raise SaveInputError(f"metadata is not JSON-serializable: {e}") from None
            spec = dataclasses.replace(
                spec,
                extras=_snapshot_extras(extras),
                reference_index=_check_reference_index(reference_index),
                dtype=_DTYPE_HINT[parse_export_dtype(dtype)] if dtype is not None else None,
                metadata=dict(metadata or {}),
            )
        return spec

    def _clear_stale(self, step_dir: Path) -> None:
        """Leader: clear what a crashed, uncommitted save of this step left behind."""
        stale = [step_dir / d for d in (layout.MODEL_DIR, layout.OPTIM_DIR, layout.EXTRAS_DIR)]
        stale = [p for p in stale if p.exists()]
        if stale:
            log.warning("removing an uncommitted earlier save of %s: %s", step_dir, [p.name for p in stale])
            for p in stale:
                shutil.rmtree(p)

    def _stage(self, stager: DefaultStager, sd: dict[str, Any]) -> _Staging:
        wrappers: list[DTensor | None] = []
        plain = _locals(sd, wrappers)
        return _Staging(stager.stage(plain), wrappers)

    def _launch(self, spec: _SaveSpec, staging: list[_Staging], early: _Failure | None) -> SaveHandle:
        committed = self._committer.submit(self._commit_clearing_frames, spec, staging, early)
        handle = SaveHandle(spec.step, spec.step_dir, tuple(st.future for st in staging), committed)
        with self._lock:
            self._inflight = handle
            self._unreported.append(handle)
        return handle

    def _start_model_write(self, spec: _SaveSpec, gate: Future) -> Future:
        """Start DCP's write of model/; its upload waits on `gate`, resolved once every rank has staged.

        Called on the committer thread (it is not free: a thread, DCP's setup, and with the process
        checkpointer a rendezvous on first use), and on every rank even after an early failure, because
        that rendezvous is a collective every rank must enter.
        """
        resp = dcp.async_save(
            {},  # ignored: the stager below hands over the staged state dict
            storage_writer=_ModelWriter(str(spec.step_dir / layout.MODEL_DIR)),
            async_stager=_AlreadyStaged(gate),
            process_group=self._group,
            async_checkpointer_type=self.checkpointer,
            no_dist=not self._distributed,
        )
        if not isinstance(resp, AsyncSaveResponse):
            raise TypeError(f"dcp.async_save returned {type(resp).__name__}, not AsyncSaveResponse")
        return resp.upload_completion

    def _order_after_compute(self) -> None:
        """With CUDA, copies on the staging side stream must start after the compute queued so far."""
        if not torch.cuda.is_available():
            return
        current = torch.accelerator.current_stream()
        for stager in (self._model_stager, self._optim_stager):
            side = getattr(stager, "_staging_stream", None)
            if side is not None:
                side.wait_stream(current)
            else:  # torch changed its internals: fall back to a full wait, correct but slower
                current.synchronize()

    def _agree(self, spec: _SaveSpec, what: str, local: _Failure | None, payload: Any = None) -> list[Any]:
        """Every rank says how `what` went on it; if it failed on any rank, raise SaveError on every rank.

        Returns every rank's payload. A broken group (a rank died, the group's timeout ran out) fails the
        save on the ranks that see it rather than leaving them waiting.
        """
        try:
            statuses = self._comm.all_gather((local, payload))
        except Exception as e:
            raise SaveError(
                f"step {spec.step} was not committed: lost contact with the other ranks while {what}: "
                f"{type(e).__name__}: {e}",
                path=spec.step_dir,
            ) from e
        by_text: dict[str, list[int]] = {}
        for rank, (f, _) in enumerate(statuses):
            if f is not None:
                by_text.setdefault(f.text, []).append(rank)
        if by_text:
            # DCP reports one rank's write failure on every rank: say each distinct failure once
            msg = "; ".join(f"{text} (reported by {_ranks(ranks)})" for text, ranks in by_text.items())
            error = SaveError(f"step {spec.step} was not committed: {msg}", path=spec.step_dir)
            if any(f is not None and f.disk_full for f, _ in statuses):
                error.hint = "the staging disk is full: free space on the staging root and save again"
            raise error
        return [p for _, p in statuses]

    def _commit_clearing_frames(
        self, spec: _SaveSpec, staging: list[_Staging], early: _Failure | None
    ) -> layout.CommitMarker:
        # A failure's traceback would keep the committer's frames, which hold this Stager, the staged
        # state dict and (in `_agree`) the error itself: a cycle that lives until the cyclic collector
        # runs, possibly only at interpreter exit (see _release). The messages and lines stay.
        try:
            return self._commit(spec, staging, early)
        except BaseException as exc:
            _clear_frames(exc)
            raise

    def _commit(
        self,
        spec: _SaveSpec,
        staging: list[_Staging],
        early: _Failure | None,
    ) -> layout.CommitMarker:
        """Committer thread: agree that every rank staged, let DCP write, agree that all of it was written,
        then write the marker.

        Every rank reaches every agreement whatever failed, and goes past one only if no rank failed
        before it. A rank that failed before its write therefore never enters DCP's collectives, and
        neither does any other; a failure during DCP's write is reported by DCP on every rank alike.
        """

        def failed(doing: str, e: BaseException) -> _Failure:
            f = _Failure.of(doing, e)
            log.error("step %d: save failed on rank %d: %s", spec.step, self.rank, f.text)
            # DCP's error sits in a cycle with the frames of its writer thread (which hold our process
            # group) and its traceback reaches this frame (which holds the Stager): only its text is
            # needed from here on.
            _clear_frames(e)
            e.__traceback__ = None
            return f

        local = early
        if early is not None:
            log.error("step %d: save failed on rank %d: %s", spec.step, self.rank, early.text)
        staged: list[Any] = []
        if local is None:
            try:
                staged = [st.result() for st in staging]
            except (Exception, CheckpointException) as e:
                local = failed("staging the state dict", e)
        else:
            _settle(staging)
        # Only now: DCP's setup would otherwise take CPU from the host copy, inside the training stall.
        gate: Future = Future()
        upload: Future | None = None
        try:
            upload = self._start_model_write(spec, gate)
        except (Exception, CheckpointException) as e:
            local = local or failed("starting the save", e)
        try:
            self._agree(spec, "staging", local)
        except SaveError as e:
            gate.set_exception(e)  # DCP's upload, where it started, returns without writing anything
            raise
        gate.set_result(staged[0])
        assert upload is not None  # no rank failed to start, this one included

        files: dict[str, tuple[int, int]] = {}
        extras: dict[str, tuple[int, int]] = {}
        tensors: dict[str, layout.TensorInfo] = {}
        try:
            meta = upload.result()
            tensors = _tensor_infos(meta)
            files.update({p: (s, r) for p, s, r in meta.storage_data.files})
        except (Exception, CheckpointException) as e:  # DCP's CheckpointException is a BaseException
            local = failed("writing model/", e)
        if len(staged) > 1:  # optimizer state (on every rank or none): once every model shard is written
            self._agree(spec, "writing model/", local)
            try:
                upload_optim = dcp.async_save(
                    staged[1],
                    storage_writer=_OptimWriter(str(spec.step_dir / layout.OPTIM_DIR)),
                    async_stager=_AlreadyStaged(staged[1]),
                    process_group=self._group,
                    async_checkpointer_type=self.checkpointer,
                    no_dist=not self._distributed,
                )
                files.update({p: (s, r) for p, s, r in upload_optim.result().storage_data.files})
            except (Exception, CheckpointException) as e:
                local = failed("writing optim/", e)
        if local is None and self.rank == 0:
            try:
                extras = _write_extras(spec.step_dir, spec.extras)
            except Exception as e:
                local = failed("writing extras/", e)
        # Rank 0 also hands over its descriptive arguments, which go into every node's marker.
        described = (spec.reference_index, spec.dtype, spec.metadata) if self.rank == 0 else None
        payloads = self._agree(spec, "writing", local, (extras, time.time(), described))
        extras, created, (reference_index, dtype, metadata) = payloads[0]
        files.update(extras)  # written by rank 0
        mine = {p: s for p, (s, r) in files.items() if self.topology.node(r) == self._node}
        local = None
        try:
            marker = layout.CommitMarker(
                step=spec.step,
                world_size=self.world_size,
                files=tuple(layout.StagedFile(p, s) for p, s in sorted(mine.items())),
                created=created,  # rank 0's clock: every rank returns the same marker
                reference_index=reference_index,
                dtype=dtype,
                metadata=metadata,
                tensors=tensors,
                staging_node=self._node,
                staging_nodes=self.topology.num_nodes,
            )
            if self._is_leader:
                # The writers fsynced their files and model/ optim/ extras/; the step dir's own entries and
                # its entry in the root are made durable here, off the training's critical path.
                layout.fsync_dir(spec.step_dir)
                layout.fsync_dir(spec.step_dir.parent)
                layout.write_marker(spec.step_dir, marker)
                log.info("committed step %d: %d files, %d bytes", spec.step, len(mine), sum(mine.values()))
        except Exception as e:  # e.g. the disk filled up after the shards: no marker, say so everywhere
            local = failed("writing the commit marker", e)
        self._agree(spec, "committing", local)
        return marker
