"""The committer: everything a save does after `save()` returns, on one background thread.

Once this rank's host copy is done, the ranks check in (staging), agree which rank writes each replicated
block (`placement`), and each rank writes all of its part in one go (`shard_files`): its model
shard, its optimizer state and the optimizer's other leaves, and on rank 0 the extras, on the writer's
threads, each file fsynced. The ranks then check in that all of it was written and only then the commit
marker is written (and they check in once more that it was).

A failure before the write (the host copy, clearing a stale step directory) stops every rank before
anything is written; a failure during it (a full disk) or after it (the marker) fails the next check-in,
on every rank alike.
"""

from __future__ import annotations

import logging
import math
import time
from functools import partial
from pathlib import Path
from typing import Any

from stagerd.contract import commit_marker
from stagerd.contract.dtypes import safetensors_name
from stagerd.contract.root_lock import held, lock_path
from stagerd.training.collectives import Collectives
from stagerd.training.failures import RankFailure, check_in, clear_frames, failed_here
from stagerd.training.host_copy import Staging, settle
from stagerd.training.marker import clear_failed, write_commit, write_extras
from stagerd.training.placement import Assigner, Block, Local, blocks_to_write, local_blocks, pooled_summary
from stagerd.training.save_inputs import SaveSpec
from stagerd.training.shard_files import (
    OPTIM_FILE_BYTES,
    FileJob,
    ShardWriter,
    WriteError,
    model_file,
    objects_file,
    objects_job,
    optim_file,
    safetensors_job,
    split_by_size,
)
from stagerd.training.topology import StagingTopology

log = logging.getLogger("stagerd.stage")

UNWATCHED = "no `stagerd watch` runs on"  # how the note of a ROOT no daemon holds begins


def _nbytes(blocks: list[Block]) -> int:
    return sum(b.host.numel() * b.host.element_size() for b in blocks)


def _tensor_infos(blocks: list[Block]) -> dict[str, commit_marker.TensorInfo]:
    """Global dtype and shape of each tensor whose first block this rank writes (each is named once)."""
    return {
        b.name: commit_marker.TensorInfo(safetensors_name(b.host.dtype), b.global_shape)
        for b in blocks
        if not any(b.offsets)
    }


class Committer:
    """Runs the check-ins, the writes and the marker of each save, in the same order on every rank."""

    def __init__(self, comm: Collectives, topology: StagingTopology, writer: ShardWriter) -> None:
        self._comm = comm
        self._topology = topology
        self._writer = writer
        self._assigner = Assigner()
        self._rank = comm.rank
        self._node = topology.node(comm.rank)
        self._is_leader = topology.leader(self._node) == comm.rank
        self._looked_for_daemon = False

    def commit(
        self,
        spec: SaveSpec,
        staging: dict[str, Staging],
        objects: dict[str, Any] | None,
        early: RankFailure | None,
    ) -> commit_marker.CommitMarker:
        """Committer thread: the save's commit marker for this rank's node, or SaveError on every rank."""
        # A failure's traceback would keep the committer's frames, which hold the Stager, the staged
        # state dict and (in `check_in`) the error itself: a cycle that lives until the cyclic collector
        # runs, possibly only at interpreter exit (see `shutdown`). The messages and lines stay.
        try:
            return self._commit(spec, staging, objects, early)
        except BaseException as exc:
            clear_frames(exc)
            raise

    def _plan(
        self, spec: SaveSpec, kinds: dict[str, Local], local: RankFailure | None
    ) -> dict[str, list[Block]]:
        """Check in that every rank staged; agree who writes each pooled block; this rank's blocks."""
        digest, items, loads = pooled_summary(kinds)
        payloads = check_in(self._comm, spec, "staging", local, (digest, loads))
        digests, all_loads = [p[0] for p in payloads], [p[1] for p in payloads]
        if not self._assigner.known(digests):  # the same decision on every rank: the digests are shared
            lists = check_in(self._comm, spec, "planning", None, items)
            self._assigner.learn(digests, lists, all_loads)
        return blocks_to_write(kinds, self._assigner.owner(), self._rank)

    def _jobs(self, owned: dict[str, list[Block]], objects: dict[str, Any] | None) -> list[FileJob]:
        rank = self._rank
        jobs = []
        if owned.get("model"):
            jobs.append(safetensors_job(model_file(rank), owned["model"]))
        if "optim" in owned:
            blocks = owned["optim"]
            files = max(1, min(self._writer.threads, math.ceil(_nbytes(blocks) / OPTIM_FILE_BYTES)))
            for i, group in enumerate(split_by_size(blocks, files)):
                if group or i == 0:
                    jobs.append(safetensors_job(optim_file(rank, i), group))
            jobs.append(objects_job(objects_file(rank), objects or {}))
        # The largest first: it bounds the write, so it starts first.
        return sorted(jobs, key=lambda j: -j.size)

    def _commit(
        self,
        spec: SaveSpec,
        staging: dict[str, Staging],
        objects: dict[str, Any] | None,
        early: RankFailure | None,
    ) -> commit_marker.CommitMarker:
        comm, rank = self._comm, self._rank
        local = early
        if early is not None:
            log.error("step %d: save failed on rank %d: %s", spec.step, rank, early.text)
        kinds: dict[str, Local] = {}
        if local is None:
            try:
                kinds = {kind: local_blocks(st.result(), comm.world) for kind, st in staging.items()}
            except Exception as e:
                local = failed_here(spec, rank, "staging the state dict", e)
        else:
            settle(staging.values())
        owned = self._plan(spec, kinds if local is None else {}, local)
        del kinds

        files: dict[str, tuple[int, int]] = {}
        extras: dict[str, tuple[int, int]] = {}
        try:
            written = self._writer.write(spec.step_dir, self._jobs(owned, objects))
            files.update({p: (s, rank) for p, s in written.items()})
        except WriteError as e:
            local = failed_here(spec, rank, f"writing {e.rel}", e.cause)
        except Exception as e:
            local = failed_here(spec, rank, "writing the step's files", e)
        tensors = _tensor_infos(owned.get("model", []))
        del owned
        if local is None and rank == 0:
            try:
                extras = write_extras(spec.step_dir, spec.extras)
            except Exception as e:
                local = failed_here(spec, rank, "writing extras/", e)
        # Rank 0 also hands over its descriptive arguments, which go into every node's marker.
        described = (
            (spec.reference_index, spec.dtype, spec.metadata, spec.hub_plan, spec.adapter_plan)
            if rank == 0
            else None
        )
        # A failed save removes what it wrote (the leader, once no rank writes any more).
        cleanup = partial(clear_failed, spec.step_dir) if self._is_leader else None
        payloads = check_in(
            comm, spec, "writing", local, (files, tensors, extras, time.time(), described), on_failure=cleanup
        )
        # In rank order on every rank (its own first, each rank's differed): every node's leader writes
        # one marker of the save, whose tensor order is the order the export fills its files in.
        tensors = {}
        for f, t, _, _, _ in payloads:
            files.update(f)
            tensors.update(t)
        _, _, extras, created, (reference_index, dtype, metadata, hub_plan, adapter_plan) = payloads[0]
        files.update(extras)  # written by rank 0
        mine = {p: s for p, (s, r) in files.items() if self._topology.node(r) == self._node}
        local = None
        try:
            marker = commit_marker.CommitMarker(
                step=spec.step,
                world_size=comm.world,
                files=tuple(commit_marker.StagedFile(p, s) for p, s in sorted(mine.items())),
                created=created,  # rank 0's clock: every rank returns the same marker
                reference_index=reference_index,
                dtype=dtype,
                metadata=metadata,
                tensors=tensors,  # in the order saved (rank 0's first): the export fills files in it
                staging_node=self._node,
                staging_nodes=self._topology.num_nodes,
                hub_plan=hub_plan,
                adapter_plan=adapter_plan,
            )
            if self._is_leader:
                write_commit(spec.step_dir, marker)
        except Exception as e:  # e.g. the disk filled up after the shards: no marker, say so everywhere
            local = failed_here(spec, rank, "writing the commit marker", e)
        check_in(comm, spec, "committing", local, on_failure=cleanup)
        if self._is_leader and not self._looked_for_daemon:
            self._looked_for_daemon = True
            _say_if_unwatched(spec.step_dir.parent, spec.step)
        return marker


def _say_if_unwatched(root: Path, step: int) -> None:
    """At a Stager's first commit on each node: a ROOT no daemon holds keeps every step, exported,
    published and deleted by none, until its disk fills (a daemon not started yet, or started on another
    path). Said once: a `watch --once` when the training ends is a way to run it too."""
    if held(lock_path(root)) is False:
        log.warning(
            "%s %s now: step %d and the steps after it stay there, not exported, published or deleted, "
            "until one does (`stagerd watch %s --sink URL`; `--once` after training)",
            UNWATCHED,
            root,
            step,
            root,
        )
