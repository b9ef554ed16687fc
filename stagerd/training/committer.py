"""The committer: everything a save does after `save()` returns, on one background thread.

Once every rank's host copy is done (a check-in), `dcp.async_save` writes this rank's `model/` shard with
`HuggingFaceStorageWriter(save_distributed=True)`, then the optimizer state goes to `optim/` in DCP's own
format (`FileSystemWriter`), rank 0 writes `extras/`, the ranks check in that all of it succeeded, and
only then the commit marker is written (and the ranks check in once more that it was).

A failure before the write (the host copy, clearing a stale step directory, starting DCP) stops every
rank before DCP's collectives; DCP itself reports a failure during the write on every rank; a failure
after it (extras, the marker) fails the write or commit check-in.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from stagerd.contract import layout
from stagerd.training.collectives import Collectives
from stagerd.training.failures import RankFailure, check_in, clear_frames, failed_here
from stagerd.training.host_copy import Staging, settle
from stagerd.training.marker import tensor_infos, write_commit, write_extras
from stagerd.training.save_inputs import SaveSpec
from stagerd.training.topology import StagingTopology
from stagerd.training.writers import ModelWriter, OptimWriter, staged_files, start_write

log = logging.getLogger("stagerd.stage")

# How long a refused save waits for DCP's upload thread to finish creating its checkpoint process.
SETTLE_TIMEOUT_S = 300.0


def _settle(upload: Future[Metadata]) -> None:
    """Wait for a gated-off upload to return before the next save may start another.

    With the process checkpointer, the first upload creates DCP's checkpoint process (a rendezvous of
    every rank's) on its own thread, and the next save rendezvouses for a new one if it does not exist
    yet. Left running, the two creations race on every rank, and ranks that keep different processes
    lose their peers mid-write ("Connection closed by peer").
    """
    try:
        upload.result(timeout=SETTLE_TIMEOUT_S)
    except TimeoutError:
        log.warning("DCP's upload thread still running %.0f s after a refused save", SETTLE_TIMEOUT_S)
    except (Exception, CheckpointException):  # the gate's error, as expected
        pass


class Committer:
    """Runs the check-ins, DCP's writes and the marker of each save, in the same order on every rank."""

    def __init__(
        self,
        comm: Collectives,
        topology: StagingTopology,
        checkpointer: AsyncCheckpointerType,
    ) -> None:
        self._comm = comm
        self._topology = topology
        self._checkpointer = checkpointer
        self._rank = comm.rank
        self._node = topology.node(comm.rank)
        self._is_leader = topology.leader(self._node) == comm.rank

    @property
    def _group(self) -> dist.ProcessGroup | None:
        return self._comm.group

    def commit(
        self, spec: SaveSpec, staging: list[Staging], early: RankFailure | None
    ) -> layout.CommitMarker:
        """Committer thread: the save's commit marker for this rank's node, or SaveError on every rank."""
        # A failure's traceback would keep the committer's frames, which hold the Stager, the staged
        # state dict and (in `check_in`) the error itself: a cycle that lives until the cyclic collector
        # runs, possibly only at interpreter exit (see `shutdown`). The messages and lines stay.
        try:
            return self._commit(spec, staging, early)
        except BaseException as exc:
            clear_frames(exc)
            raise

    def _start_model_write(self, spec: SaveSpec, gate: Future[Any]) -> Future[Metadata]:
        """Start DCP's write of model/; its upload waits on `gate`, resolved once every rank has staged.

        Called on the committer thread (it is not free: a thread, DCP's setup, and with the process
        checkpointer a rendezvous on first use), and on every rank even after an early failure, because
        that rendezvous is a collective every rank must enter.
        """
        writer = ModelWriter(str(spec.step_dir / layout.MODEL_DIR))
        return start_write(gate, writer, group=self._group, checkpointer=self._checkpointer)

    def _commit(
        self, spec: SaveSpec, staging: list[Staging], early: RankFailure | None
    ) -> layout.CommitMarker:
        """Check in that every rank staged, let DCP write, check in that all of it was written, then write
        the marker.

        Every rank reaches every check-in whatever failed, and goes past one only if no rank failed
        before it. A rank that failed before its write therefore never enters DCP's collectives, and
        neither does any other; a failure during DCP's write is reported by DCP on every rank alike.
        """
        comm, rank = self._comm, self._rank
        local = early
        if early is not None:
            log.error("step %d: save failed on rank %d: %s", spec.step, rank, early.text)
        staged: list[Any] = []
        if local is None:
            try:
                staged = [st.result() for st in staging]
            except (Exception, CheckpointException) as e:
                local = failed_here(spec, rank, "staging the state dict", e)
        else:
            settle(staging)
        # Only now: DCP's setup would otherwise take CPU from the host copy, inside the training stall.
        gate: Future[Any] = Future()
        upload: Future[Metadata] | None = None
        try:
            upload = self._start_model_write(spec, gate)
        except (Exception, CheckpointException) as e:
            local = local or failed_here(spec, rank, "starting the save", e)
        try:
            check_in(comm, spec, "staging", local)
        except Exception as e:
            gate.set_exception(e)  # DCP's upload, where it started, returns without writing anything
            if upload is not None:
                _settle(upload)
            raise
        gate.set_result(staged[0])
        assert upload is not None  # no rank failed to start, this one included

        files: dict[str, tuple[int, int]] = {}
        extras: dict[str, tuple[int, int]] = {}
        tensors: dict[str, layout.TensorInfo] = {}
        try:
            meta = upload.result()
            tensors = tensor_infos(meta)
            files.update(staged_files(meta))
        except (Exception, CheckpointException) as e:  # DCP's CheckpointException is a BaseException
            local = failed_here(spec, rank, "writing model/", e)
        if len(staged) > 1:  # optimizer state (on every rank or none): once every model shard is written
            check_in(comm, spec, "writing model/", local)
            try:
                writer = OptimWriter(str(spec.step_dir / layout.OPTIM_DIR))
                written = start_write(staged[1], writer, group=self._group, checkpointer=self._checkpointer)
                files.update(staged_files(written.result()))
            except (Exception, CheckpointException) as e:
                local = failed_here(spec, rank, "writing optim/", e)
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
        payloads = check_in(comm, spec, "writing", local, (extras, time.time(), described))
        extras, created, (reference_index, dtype, metadata, hub_plan, adapter_plan) = payloads[0]
        files.update(extras)  # written by rank 0
        mine = {p: s for p, (s, r) in files.items() if self._topology.node(r) == self._node}
        local = None
        try:
            marker = layout.CommitMarker(
                step=spec.step,
                world_size=comm.world,
                files=tuple(layout.StagedFile(p, s) for p, s in sorted(mine.items())),
                created=created,  # rank 0's clock: every rank returns the same marker
                reference_index=reference_index,
                dtype=dtype,
                metadata=metadata,
                tensors=tensors,
                staging_node=self._node,
                staging_nodes=self._topology.num_nodes,
                hub_plan=hub_plan,
                adapter_plan=adapter_plan,
            )
            if self._is_leader:
                write_commit(spec.step_dir, marker)
        except Exception as e:  # e.g. the disk filled up after the shards: no marker, say so everywhere
            local = failed_here(spec, rank, "writing the commit marker", e)
        check_in(comm, spec, "committing", local)
        return marker
