"""The training-side library: `Stager`, an async save into node-local staging with a commit marker.

    stager = Stager(root="/local_nvme/ckpt")   # every rank, after init_process_group
    stager.attach(optimizer)                   # optimizer.step() waits for a save's host copy
    for step in ...:
        loss = model(batch).loss; loss.backward()
        optimizer.step(); optimizer.zero_grad()
        if step % save_every == 0:
            stager.save(model.state_dict(), step=step, extras={"config.json": cfg}, dtype="bf16",
                        optimizer_state=get_state_dict(model, optimizer)[1])  # by name, as load() takes it
    stager.wait()    # before exit: every save durable and committed (raises SaveError on failure)
    stager.close()

`save()` takes the tensors and returns; the device-to-host copy (`host_copy`, into the Stager's own host
buffers, `host_pool`) runs on a side stream under the next forward and backward, since nothing changes
the parameters before the next optimizer step; the buffers a forward updates in place (BatchNorm's
running statistics) are copied before `save()` returns (`eager`). `wait_staged()` blocks until the copy
is done: call it right before the next `optimizer.step()`, or let `attach(optimizer)` make the optimizer
call it. While the copy runs, `save()` (`save_start`) checks the arguments and the step (`save_inputs`)
and checks in with the other ranks (one small gloo all_reduce, `failures`) before anything is written.
Everything else runs behind it, on the committer thread (`committer`): one write per rank of its model
shard, optimizer state and extras (`shard_files`, at the disk's speed), then the commit marker (`marker`).
How the root is shared between nodes is probed at construction (`topology`); what `close()` and the
process's exit stop is in `shutdown`. Nothing here uses torch's private checkpoint staging or async-save
machinery.

Host buffers are allocated (and, with CUDA, page-locked) on first use and reused by every later save of
the same tensors; `attach()` and `reserve()` allocate them in the background ahead of the first save.

Resuming: `stager.load(model_sd, optim_sd, step=None)` loads the newest (or the given) committed step
into the state dicts in place and returns its step; `stager.loaded` holds its extras. All ranks agree on
the step first, so a step some ranks cannot see fails alike everywhere (`loader`).

Only one save is in flight at a time: a `save()` issued while the previous one is still writing waits for
it first (and logs how long), because both use the same host buffers and the same group (`inflight`). The
Stager owns a gloo process group of its own, so its background collectives never interleave with the
training's.
"""

from __future__ import annotations

import contextlib
import logging
import numbers
import os
import warnings
import weakref
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.hooks import RemovableHandle

from stagerd.contract import commit_marker, layout
from stagerd.errors import ConfigError, LoadError, SaveError
from stagerd.training import optimizer_hook, shutdown, to_hub
from stagerd.training.collectives import Collectives
from stagerd.training.committer import Committer
from stagerd.training.handle import SaveHandle
from stagerd.training.host_copy import HostCopier, reserve_keys
from stagerd.training.host_pool import HostPool
from stagerd.training.inflight import Inflight
from stagerd.training.loader import LoadedStep, load_export, load_step
from stagerd.training.save_start import start_save
from stagerd.training.shard_files import ShardWriter
from stagerd.training.state_tree import split_leaves
from stagerd.training.topology import StagingTopology, discover, node_id

__all__ = ["LoadedStep", "SaveHandle", "Stager", "StagingTopology"]

log = logging.getLogger("stagerd.stage")

CHECKPOINTERS = ("thread", "process")


def _checkpointer(value: Any) -> str:
    """The accepted spellings of the old `checkpointer` argument (a string or torch's enum)."""
    name = "thread" if value is None else str(getattr(value, "value", value))
    if name not in CHECKPOINTERS:
        raise ConfigError(f"checkpointer must be 'thread' or 'process': {value!r}")
    return name


def default_writer_threads() -> int:
    """Writer threads per rank: a share of this node's cores (at most 8: a disk saturates before)."""
    ranks_here = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
    return max(2, min(8, (os.cpu_count() or 2) // ranks_here))


class Stager:
    """Async saves into `root/step-XXXXXXXX/`, committed by `stagerd.commit.json`. One per process."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        process_group: dist.ProcessGroup | None = None,
        checkpointer: Any = None,
        pin_memory: bool | None = None,
        timeout: float | None = None,
        writer_threads: int | None = None,
    ) -> None:
        """`timeout` (seconds) bounds each collective of the Stager's own gloo group, so it must exceed
        the slowest rank's write; default: torch's default for the group (30 min). `pin_memory`: page-lock
        the host buffers (default: with CUDA). `writer_threads`: this rank's writer threads (default: a
        share of the node's cores, 2 to 8). `checkpointer` ("thread" or "process") is accepted for
        compatibility and changes nothing: the write always runs on the writer's threads, whose
        `pwrite`s and fsyncs run without the GIL."""
        self.root = Path(root)
        self._made_root = not self.root.exists()  # a load finding no step then says ROOT did not exist
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(
                f"cannot use it as the Stager's root: {e.strerror or e}",
                path=root,
                hint="pass a directory (or a path one can be made at) on the node's staging disk",
            ) from None
        if self._made_root:  # a new run's first save goes there; a typo'd path shows up here
            log.info("made the Stager's root %s: it did not exist", self.root)
        self.checkpointer = _checkpointer(checkpointer)
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
            # DCP says so on every load; single-process loading is what was asked for here.
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        self._comm = Collectives(self._group)
        self.rank, self.world_size = self._comm.rank, self._comm.world
        self.topology = discover(self.root, self._comm, node_id())
        self._is_leader = self.topology.leader(self.topology.node(self.rank)) == self.rank

        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self._pools = {kind: HostPool(pin=self.pin_memory, name=kind) for kind in ("model", "optim")}
        self._copy_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stagerd-copy")
        self._copier = HostCopier(self._pools, self._copy_thread)
        self._writer = ShardWriter(writer_threads or default_writer_threads())
        self._hooks: list[RemovableHandle] = []
        self._attached: weakref.WeakKeyDictionary[torch.optim.Optimizer, RemovableHandle] = (
            weakref.WeakKeyDictionary()
        )
        self._committer = Committer(self._comm, self.topology, self._writer)
        self._commit_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stagerd-commit")
        self._saves = Inflight()
        self._hub_plans = to_hub.PlanCache()
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
        `extras`: name -> a dict or list (saved as JSON), JSON text, bytes, a file path, or a config object
        (`model.config`, saved as save_pretrained writes it).

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
        step = _plain_step(step)
        self._saves.wait_previous(step)
        return self._saves.add(
            start_save(
                self,
                state_dict,
                step,
                extras=extras,
                reference_index=reference_index,
                dtype=dtype,
                optimizer_state=optimizer_state,
                metadata=metadata,
                model=model,
                mapping=mapping,
            )
        )

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
        if (h := self._saves.latest) is not None:  # a save still writing: load what it commits too
            with contextlib.suppress(Exception):  # its failure is reported by its handle and by wait()
                h.committed.result()
        step = _plain_step(step)
        self.loaded = load_step(
            self._comm, self.root, state_dict, optimizer_state, step, made=self._made_root
        )
        return self.loaded.step

    def load_export(self, directory: str | os.PathLike[str], state_dict: Mapping[str, Any]) -> None:
        """Load a published HF export directory into a model state dict, in place (a fine-tune's start).

        Collective like `load`; the export's tensors are cast back to the state dict's dtypes."""
        if self._closed:
            raise LoadError("the Stager is closed")
        load_export(self._comm, directory, state_dict)

    def wait_staged(self, timeout: float | None = None) -> None:
        """Block until the latest save's host copy is complete: call it right before the next
        `optimizer.step()` (the copy then runs under the forward and backward in between), or let
        `attach(optimizer)` call it. Raises SaveError if the copy failed."""
        h = self._saves.latest
        if h is not None:
            h.wait_staged(timeout)

    def attach(self, optimizer: torch.optim.Optimizer) -> RemovableHandle:
        """Make `optimizer.step()` call `wait_staged()` before it updates anything, and reserve the host
        buffers ahead of the first save: after the optimizer's first step (its state then exists), on a
        background thread.

        The step is the one place the parameters and the optimizer state change, so a save's host copy
        runs under the forward and backward that follow it; a step given a closure (Lightning runs
        forward and backward in it) waits after the closure. Attach every optimizer whose state or
        parameters are saved (of Accelerate's prepared optimizer, the torch optimizer inside it, whose
        step runs its hooks); attaching one twice does nothing more. Returns the wait hook's handle
        (`.remove()`); `close()` removes it too (`optimizer_hook`).
        """
        optimizer = optimizer_hook.hookable(optimizer)
        held = self._attached.get(optimizer)
        if held is not None and optimizer_hook.hooked(held):
            return held
        wait, reserve = optimizer_hook.install(self, optimizer)
        self._hooks += [wait, reserve]
        self._attached[optimizer] = wait
        return wait

    def reserve(
        self,
        state_dict: Mapping[str, Any],
        optimizer_state: Mapping[str, Any] | None = None,
        *,
        wait: bool = False,
    ) -> None:
        """Allocate (and with CUDA page-lock) the host buffers of these state dicts on a background
        thread, so that the first save copies at full speed; returns at once, or once they are all there
        with `wait=True` (at set-up, before the loop). Optional: a save allocates what is missing."""
        self._reserve("model", split_leaves(state_dict, "state_dict")[0].values())
        if optimizer_state is not None:
            self._reserve("optim", split_leaves(optimizer_state, "optimizer_state")[0].values())
        if wait:
            for pool in self._pools.values():
                pool.wait_reserved()

    def _reserve(self, kind: str, tensors: Iterable[Any]) -> None:
        if self._closed:
            return
        keys = reserve_keys(t for t in tensors if isinstance(t, torch.Tensor) and not t.is_meta)
        self._pools[kind].reserve(keys)

    def wait(self) -> list[commit_marker.CommitMarker]:
        """Block until every save is durable and committed. Raises SaveError if any failed since last wait."""
        return self._saves.report()

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
        out: dict[int, int] = {}
        for pool in self._pools.values():
            out.update(pool.sizes())
        return out

    def step_dir(self, step: int) -> Path:
        return self.root / layout.step_dir_name(step)

    # -- internals ---------------------------------------------------------------------------------

    def _release(self) -> None:
        # The committer may still be inside a collective of our group, so it stops first and the group last.
        self._closed = True
        shutdown.closed(self)
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self._attached.clear()
        self._commit_thread.shutdown(wait=True)
        self._copy_thread.shutdown(wait=True)
        self._writer.close()
        for pool in self._pools.values():
            pool.close()
        self._saves.forget()
        if self._group is not None:
            with contextlib.suppress(Exception):  # already destroyed by destroy_process_group()
                dist.destroy_process_group(self._group)
            self._group = None
            self._comm.group = None


def _plain_step(step: Any) -> Any:
    """A numpy integer as the int it is; anything else as given, for the checks that refuse it by name."""
    return int(step) if isinstance(step, numbers.Integral) and not isinstance(step, bool) else step
