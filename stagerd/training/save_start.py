"""Starting one save (`Stager.save`): the host copy first, then, under it, the arguments and the step
checked and every rank checked in, and only then the write and the commit handed to the committer thread.

A rank that refuses the save makes every rank raise at the check-in, before anything is written; after
it, a failure on one rank travels into the committer's check-ins, which every rank reaches.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol

import torch
from torch.utils.hooks import RemovableHandle

from stagerd.contract import layout
from stagerd.errors import SaveInputError, StagerdError, StepExistsError
from stagerd.training import optimizer_hook, to_hub
from stagerd.training.aliases import split_aliases
from stagerd.training.collectives import Collectives
from stagerd.training.committer import Committer
from stagerd.training.eager import Owners
from stagerd.training.failures import RankFailure, check_in_to_start, raise_without_cycle
from stagerd.training.handle import SaveHandle
from stagerd.training.host_copy import HostCopier, Pace, Staging, completion, settle
from stagerd.training.host_pool import HostPool
from stagerd.training.leaf_check import check_tensors, check_values
from stagerd.training.marker import clear_stale
from stagerd.training.save_inputs import SaveSpec, describe_save, resolve_state
from stagerd.training.state_tree import split_leaves
from stagerd.training.to_hub import ToHub


class Starter(Protocol):
    """The parts of a `Stager` that starting a save uses."""

    rank: int
    _is_leader: bool
    _comm: Collectives
    _pools: dict[str, HostPool]
    _copy_thread: ThreadPoolExecutor
    _copier: HostCopier
    _attached: weakref.WeakKeyDictionary[torch.optim.Optimizer, RemovableHandle]
    _committer: Committer
    _commit_thread: ThreadPoolExecutor
    _hub_plans: to_hub.PlanCache

    def step_dir(self, step: int) -> Path: ...


def start_save(
    s: Starter,
    state_dict: Mapping[str, Any],
    step: int,
    *,
    extras: Mapping[str, Any] | None,
    reference_index: str | os.PathLike[str] | Mapping[str, Any] | None,
    dtype: str | None,
    optimizer_state: Mapping[str, Any] | None,
    metadata: Mapping[str, Any] | None,
    model: Any,
    mapping: Any,
) -> SaveHandle:
    """`Stager.save` once the previous save is out of the way: returns once the host copy has started."""
    error: StagerdError | None = None
    spec: SaveSpec | None = None
    optim_sd = None
    objects: dict[str, Any] | None = None
    staging: dict[str, Staging] = {}
    pace: Pace | None = None
    try:
        model_sd, optim_sd = resolve_state(state_dict, step, optimizer_state)
        model_sd, aliases = split_aliases(model_sd)
        model_tensors, _ = split_leaves(model_sd, "state_dict")
        # Start the host copy first: the optimizer state's walk, the checks and the check-in below
        # then overlap it. Nothing is written to disk before the check-in; a refused save only filled
        # our own staging buffers.
        if optim_sd is None:  # ahead of the copy on its thread, so the save ends after it
            s._copy_thread.submit(s._pools["optim"].release)
        # What no waiting optimizer step owns is copied now, before the next forward (`eager`).
        owners = Owners.of(model, [o for o, h in s._attached.items() if optimizer_hook.hooked(h)])
        copy = s._copier.start(
            {"model": (model_tensors, owners.eager(model_tensors))}, more=optim_sd is not None
        )
        staging, pace = copy.staging, copy.pace
        if optim_sd is not None:
            try:
                optim_tensors, objects = split_leaves(optim_sd, "optimizer_state")
                check_tensors(optim_tensors, "optimizer_state")
                check_values(objects, "optimizer_state")
                copy.add("optim", optim_tensors, owners.eager(optim_tensors))
            finally:
                copy.close()
        spec = describe_save(
            step,
            s.step_dir(step),
            rank=s.rank,
            extras=extras,
            reference_index=reference_index,
            dtype=dtype,
            metadata=metadata,
            to_hub=_to_hub(s, model, mapping, model_sd, aliases, extras) if s.rank == 0 else None,
        )
        if s._is_leader and layout.is_committed(spec.step_dir):
            raise StepExistsError("step is already committed; refusing to overwrite it", path=spec.step_dir)
    except StagerdError as e:
        error = e
    except Exception as e:  # anything unexpected must still reach the check-in below, or ranks hang
        error = SaveInputError(f"cannot save step {step!r}: {type(e).__name__}: {e}")
    try:
        check_in_to_start(s._comm, step, error, optim_sd is not None)
    except BaseException as refused:
        if pace is not None:
            pace.hurry()
        settle(staging.values())
        # Raised from this frame, `refused` (and `error`) would be kept by its own traceback: a cycle
        # holding the caller's state dict, its mesh and process groups (see `shutdown`).
        error = None
        raise_without_cycle(refused)
    assert spec is not None  # no rank refused, this one included
    # From here on a failure on one rank must not leave the others waiting in a collective it never
    # enters: it is carried into the committer's check-ins, which every rank reaches.
    early: RankFailure | None = None
    if s._is_leader:
        try:  # before any rank writes: the writes wait for the committer's staging check-in
            clear_stale(spec.step_dir)
        except Exception as e:
            early = RankFailure.of(f"clearing an uncommitted earlier save of {spec.step_dir.name}", e)
    committed = s._commit_thread.submit(s._committer.commit, spec, staging, objects, early)
    futures = tuple(completion(st.future) for st in staging.values())
    assert pace is not None
    pace.steady()
    return SaveHandle(spec.step, spec.step_dir, futures, committed, pace.hurry)


def _to_hub(
    s: Starter, model: Any, mapping: Any, sd: dict[str, Any], aliases: dict[str, str], extras: Any
) -> ToHub:
    config = (extras or {}).get("config.json") if mapping is None else None
    given = frozenset(extras or ())
    return s._hub_plans.get(model, sd, aliases, mapping, config, given)
