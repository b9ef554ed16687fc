"""DCP storage writers that report the size of every file they wrote, and how a write is started.

Each rank's writer stats the files it wrote (after torch fsynced them) and fsyncs their directory; the
sizes travel inside the DCP write results, which DCP gathers on the coordinator, where `finish()` runs
only after every rank wrote. The gathered list comes back to every rank in the returned `Metadata`
(`metadata.storage_data`), which is where the commit marker's file list comes from.
"""

from __future__ import annotations

import dataclasses
import os
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter, HuggingFaceStorageWriter
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, AsyncSaveResponse
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult

from stagerd.contract import layout
from stagerd.errors import SaveError


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


def _annotated(
    results: torch.futures.Future[list[WriteResult]], directory: Path, subdir: str, rank: int
) -> torch.futures.Future[list[WriteResult]]:
    out: torch.futures.Future[list[WriteResult]] = torch.futures.Future()
    out.set_result(_annotate(results.wait(), directory, subdir, rank))
    return out


class ModelWriter(HuggingFaceStorageWriter):
    """HF safetensors shards, one per rank (`save_distributed=True`), sizes reported to the coordinator."""

    def __init__(self, path: str) -> None:
        super().__init__(path, save_distributed=True)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> torch.futures.Future[list[WriteResult]]:
        return _annotated(
            super().write_data(plan, planner), Path(self.path), layout.MODEL_DIR, self.rank or 0
        )

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        plain, files = _unwrap(results)
        super().finish(metadata, plain)
        # Runs on the coordinator after every rank wrote; DCP broadcasts `metadata` back to all ranks.
        metadata.storage_data = _staged_files(files)


class OptimWriter(FileSystemWriter):
    """Optimizer state in DCP's own format, sizes reported like the model's (plus `.metadata`)."""

    def __init__(self, path: str) -> None:
        super().__init__(path, overwrite=True)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> torch.futures.Future[list[WriteResult]]:
        return _annotated(
            super().write_data(plan, planner), Path(self.path), layout.OPTIM_DIR, self.rank or 0
        )

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


def start_write(
    staged: Any,
    writer: StorageWriter,
    *,
    group: dist.ProcessGroup | None,
    checkpointer: AsyncCheckpointerType,
) -> Future[Metadata]:
    """Start DCP's write of `staged` (a state dict, or a Future of one); returns the upload's Future.

    DCP answers an AsyncSaveResponse when it is handed a Future to stage, a bare Future otherwise.
    """
    resp = dcp.async_save(
        {},  # ignored: the stager below hands over the staged state dict
        storage_writer=writer,
        async_stager=_AlreadyStaged(staged),
        process_group=group,
        async_checkpointer_type=checkpointer,
        no_dist=group is None,
    )
    upload = resp.upload_completion if isinstance(resp, AsyncSaveResponse) else resp
    # torch annotates upload_completion as Future[None]; it resolves to the global Metadata.
    return cast("Future[Metadata]", upload)


def staged_files(meta: Metadata) -> dict[str, tuple[int, int]]:
    """path -> (size, writing rank) of every file a write reported in its returned Metadata."""
    files = meta.storage_data
    if not isinstance(files, StagedFiles):
        raise SaveError(f"DCP returned metadata without stagerd's file list: {type(files).__name__}")
    return {p: (s, r) for p, s, r in files.files}
