"""The training-side library: `Stager`, an async DCP save into node-local staging with a commit marker.

    stager = Stager(root="/local_nvme/ckpt")          # every rank, after init_process_group
    handle = stager.save(model_sd, step=100, extras={"config.json": cfg}, dtype="bf16",
                         optimizer_state=optim_sd)
    stager.wait_staged()   # before the next optimizer step mutates the parameters
    stager.wait()          # before exit: every save durable and committed (raises SaveError on failure)
    stager.close()

`save()` starts the device-to-host copy (`host_copy`), then, while it runs, checks the arguments and the
step (`save_inputs`) and checks in with the other ranks (one small gloo all_reduce, `failures`) before
anything is written; `wait_staged()` blocks until the copy is done. Everything else runs behind it, on
the committer thread (`committer`): DCP's writes (`writers`), extras and the commit marker (`marker`).
How the root is shared between nodes is probed at construction (`topology`); what `close()` and the
process's exit stop is in `shutdown`.

Checkpointer types: `"thread"` runs the write in a thread of the training process; `"process"` runs it in
torch's checkpoint daemon process (buffers then live in shared memory), which keeps serialization and
fsync off the training process's GIL. Default: `"process"` with CUDA, `"thread"` without (no extra
process, no shared memory, nothing to spawn on a CPU box).

Resuming: `stager.load(model_sd, optim_sd, step=None)` loads the newest (or the given) committed step
into the state dicts in place and returns its step; `stager.loaded` holds its extras. All ranks agree on
the step first, so a step some ranks cannot see fails alike everywhere (`loader`).

Only one save is in flight at a time: a `save()` issued while the previous one is still writing waits for
it first (and logs how long), because both would run collectives on the same group. The Stager owns a
gloo process group of its own, so its background collectives never interleave with the training's.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
import warnings
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.staging import DefaultStager
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from stagerd.contract import layout
from stagerd.errors import ConfigError, LoadError, SaveError, SaveInputError, StagerdError, StepExistsError
from stagerd.training import shutdown, to_hub
from stagerd.training.aliases import split_aliases
from stagerd.training.collectives import Collectives
from stagerd.training.committer import Committer
from stagerd.training.failures import RankFailure, check_in_to_start, raise_without_cycle
from stagerd.training.handle import SaveHandle, outcomes
from stagerd.training.host_copy import (
    Staging,
    buffer_sizes,
    order_after_compute,
    settle,
    staging_options,
    start_staging,
)
from stagerd.training.loader import LoadedStep, load_export, load_step
from stagerd.training.marker import clear_stale
from stagerd.training.save_inputs import SaveSpec, describe_save, resolve_state
from stagerd.training.to_hub import ToHub
from stagerd.training.topology import StagingTopology, discover, node_id

__all__ = ["LoadedStep", "SaveHandle", "Stager", "StagingTopology"]


log = logging.getLogger("stagerd.stage")


def _default_checkpointer() -> AsyncCheckpointerType:
    return AsyncCheckpointerType.PROCESS if torch.cuda.is_available() else AsyncCheckpointerType.THREAD


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
        self._group: dist.ProcessGroup | None = None
        if self._distributed:
            base = process_group or dist.group.WORLD
            # A gloo group of our own: DCP needs a CPU backend, and background collectives must not
            # interleave with the training's on the same group.
            self._group = dist.new_group(
                ranks=dist.get_process_group_ranks(base),
                backend="gloo",
                use_local_synchronization=process_group is not None,  # only its members construct a Stager
                timeout=None if timeout is None else timedelta(seconds=timeout),
            )
        else:
            if self.checkpointer is AsyncCheckpointerType.PROCESS:
                raise ConfigError("the 'process' checkpointer needs torch.distributed to be initialized")
            # DCP says so on every save; single-process saving is what was asked for here.
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        self._comm = Collectives(self._group)
        self.rank, self.world_size = self._comm.rank, self._comm.world
        self.topology = discover(self.root, self._comm, node_id())
        self._is_leader = self.topology.leader(self.topology.node(self.rank)) == self.rank

        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        options = staging_options(
            pin_memory=self.pin_memory, shared_memory=self.checkpointer is AsyncCheckpointerType.PROCESS
        )
        self._model_stager = DefaultStager(options)
        self._optim_stager = DefaultStager(options)
        self._committer = Committer(self._comm, self.topology, self.checkpointer)
        self._commit_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stagerd-commit")
        self._inflight: SaveHandle | None = None
        self._hub_plans: dict[Any, ToHub] = {}
        self._unreported: list[SaveHandle] = []
        self._lock = threading.Lock()
        self._closed = False
        self.loaded: LoadedStep | None = None  # what the last `load()` loaded: step, marker, extras
        shutdown.opened(self, gloo=self._group is not None)

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
        model: Any = None,
        mapping: Any = None,
    ) -> SaveHandle:
        """Start saving `state_dict` as `step`; returns once the host copy has been started.

        Collective: every rank calls it with the same step. Raises StepExistsError if the step is already
        committed, SaveInputError / DTypeError / ReferenceIndexError for bad arguments (on every rank).

        Keys that alias another key's tensor (tied weights) are staged once. `model`: the module whose
        state dict this is; for a transformers model the export is then what `save_pretrained` writes
        (its checkpoint names and layout, tied duplicates left out), resolved here into the marker's
        to-Hub plan (HubPlanError if it cannot be). Without it, or for another model, every key is
        exported under its own name with its own bytes. `mapping`: a declarative key mapping (a
        `KeyMapping`, its JSON as a dict, or a path; `examples/torchtitan_llama_to_hf.json`) for a trainer
        whose names are not the checkpoint's.
        """
        if self._closed:
            raise SaveError("the Stager is closed")
        self._wait_previous(step)
        error: StagerdError | None = None
        spec: SaveSpec | None = None
        optim_sd = None
        staging: list[Staging] = []
        try:
            model_sd, optim_sd = resolve_state(state_dict, step, optimizer_state)
            model_sd, aliases = split_aliases(model_sd)
            # Start the host copy first: the checks and the check-in below then overlap it. Nothing is
            # written to disk before the check-in; a refused save only filled our own staging buffers.
            order_after_compute((self._model_stager, self._optim_stager))
            staging.append(start_staging(self._model_stager, model_sd))
            if optim_sd is not None:
                staging.append(start_staging(self._optim_stager, optim_sd))
            spec = describe_save(
                step,
                self.step_dir(step),
                rank=self.rank,
                extras=extras,
                reference_index=reference_index,
                dtype=dtype,
                metadata=metadata,
                to_hub=self._to_hub(model, mapping, model_sd, aliases, extras) if self.rank == 0 else None,
            )
            if self._is_leader and layout.is_committed(spec.step_dir):
                raise StepExistsError(
                    "step is already committed; refusing to overwrite it", path=spec.step_dir
                )
        except StagerdError as e:
            error = e
        except Exception as e:  # anything unexpected must still reach the check-in below, or ranks hang
            error = SaveInputError(f"cannot save step {step!r}: {type(e).__name__}: {e}")
        try:
            check_in_to_start(self._comm, step, error, optim_sd is not None)
        except BaseException as refused:
            settle(staging)
            # Raised from this frame, `refused` (and `error`) would be kept by its own traceback: a cycle
            # holding the caller's state dict, its mesh and process groups (see `shutdown`).
            error = None
            raise_without_cycle(refused)
        assert spec is not None  # no rank refused, this one included
        # From here on a failure on one rank must not leave the others waiting in a collective it never
        # enters: it is carried into the committer's check-ins, which every rank reaches.
        early: RankFailure | None = None
        if self._is_leader:
            try:  # before any rank writes: the writes wait for the committer's staging check-in
                clear_stale(spec.step_dir)
            except Exception as e:
                early = RankFailure.of(f"clearing an uncommitted earlier save of {spec.step_dir.name}", e)
        return self._launch(spec, staging, early)

    def load(
        self,
        state_dict: Mapping[str, Any],
        optimizer_state: Mapping[str, Any] | None = None,
        step: int | None = None,
    ) -> int:
        """Load the newest committed step under ROOT (or `step`) into the state dicts, in place; its step.

        Collective: every rank calls it with state dicts of the same parallelism (e.g. from
        `get_state_dict(model, optimizer)`; then `set_state_dict`). `model/` is read through DCP's HF
        reader, `optim/` through its file-system reader with an allowlist unpickler; DCP reshards, so a
        step saved with another world size loads. A step that no rank, or only some ranks, can see is the
        same `LoadError` on every rank. The extras come back in `self.loaded` (`.extras`, `.json(name)`).
        See `stagerd/training/loader.py`.
        """
        if self._closed:
            raise LoadError("the Stager is closed")
        if (h := self._inflight) is not None:  # a save still writing: load what it commits too
            with contextlib.suppress(Exception):  # its failure is reported by its handle and by wait()
                h.committed.result()
        self.loaded = load_step(self._comm, self.root, state_dict, optimizer_state, step)
        return self.loaded.step

    def load_export(self, directory: str | os.PathLike[str], state_dict: Mapping[str, Any]) -> None:
        """Load a published HF export directory into a model state dict, in place (a fine-tune's start).

        Collective like `load`; the export's tensors are cast back to the state dict's dtypes."""
        if self._closed:
            raise LoadError("the Stager is closed")
        load_export(self._comm, directory, state_dict)

    def wait_staged(self, timeout: float | None = None) -> None:
        """Block until the latest save's host copy is complete (call before the next optimizer step)."""
        h = self._inflight
        if h is not None:
            h.wait_staged(timeout)

    def wait(self) -> list[layout.CommitMarker]:
        """Block until every save is durable and committed. Raises SaveError if any failed since last wait."""
        with self._lock:
            handles, self._unreported = self._unreported, []
        markers, errors = outcomes(handles)
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
        tensors or process groups alive (see `shutdown`). Releases them even when a save failed.
        """
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._release()

    def __enter__(self) -> Stager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def staging_buffers(self) -> dict[int, int]:
        """data_ptr -> bytes of each cached host staging buffer (model and optimizer); for tests, benches."""
        return buffer_sizes((self._model_stager, self._optim_stager))

    def step_dir(self, step: int) -> Path:
        return self.root / layout.step_dir_name(step)

    # -- internals ---------------------------------------------------------------------------------

    def _release(self) -> None:
        # The committer may still be inside a collective of our group, so it stops first and the group last.
        self._closed = True
        shutdown.closed(self)
        self._commit_thread.shutdown(wait=True)
        self._model_stager.close()
        self._optim_stager.close()
        shutdown.join_dcp_executor_threads()
        # A failed save's handle holds its error, whose frames may still reach the caller's state dict.
        self._inflight = None
        self._unreported = []
        if self.checkpointer is AsyncCheckpointerType.PROCESS:
            shutdown.stop_checkpoint_process()
        if self._group is not None:
            with contextlib.suppress(Exception):  # already destroyed by destroy_process_group()
                dist.destroy_process_group(self._group)
            self._group = None
            self._comm.group = None

    def _to_hub(
        self, model: Any, mapping: Any, sd: dict[str, Any], aliases: dict[str, str], extras: Any
    ) -> ToHub:
        """Resolved once per model, config and set of tensors: later saves of the same training reuse it."""
        config = (extras or {}).get("config.json") if mapping is None else None
        key = (
            id(model),
            repr(config),
            json.dumps(mapping, sort_keys=True) if isinstance(mapping, Mapping) else str(mapping),
            tuple((k, v.shape, v.dtype) if isinstance(v, torch.Tensor) else (k,) for k, v in sd.items()),
            tuple(aliases.items()),
        )
        if key not in self._hub_plans:
            self._hub_plans = {key: to_hub.resolve(model, sd, aliases, mapping, config)}
        return self._hub_plans[key]

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

    def _launch(self, spec: SaveSpec, staging: list[Staging], early: RankFailure | None) -> SaveHandle:
        committed = self._commit_thread.submit(self._committer.commit, spec, staging, early)
        handle = SaveHandle(spec.step, spec.step_dir, tuple(st.future for st in staging), committed)
        with self._lock:
            self._inflight = handle
            self._unreported.append(handle)
        return handle
