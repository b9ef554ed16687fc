"""`StagerdCheckpointIO` under Lightning Fabric: `fabric.save(path, state)` and `fabric.load(path, state)`
through the same plugin, the loop unchanged.

Fabric hands the plugin the user's own state with each module and optimizer turned into its state dict:
`{"model": {...}, "optimizer": {...}, "step": 100}`. The step is the int under the plugin's `step_key`
("step" unless told); the model is the entry holding the state dict of `model=` (its tensors), or without
`model=` the one entry that is a flat dict of tensors. That entry is the step's model (exported as the
Trainer's plugin exports `model=`), everything else goes through `state_tree` into `optim/`, and `read`
gives the state back as Fabric's own file would hold it, no pickle. Fabric saves from global rank 0 alone,
as the Trainer's DDP does.

The save returns before its host copy is done, as under the Trainer: the optimizers of the state the user
gave `fabric.save` (read from its frame on the call stack: the strategy sees only their state dicts) are
attached to the Stager, so the next `optimizer.step()` waits for the copy (`attach_to`). The save waits
for the copy itself where no step is known to come before the saved tensors change: no optimizer in the
state (or one with train and eval modes, switched in place), or a buffer of the state's modules that the
Stager copies in the background (over `EAGER_MAX_BYTES`, of no `model=`) while a forward may update it.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

import torch

from stagerd.errors import ConfigError
from stagerd.training.config_model import uncompiled
from stagerd.training.eager import EAGER_MAX_BYTES
from stagerd.training.optimizer_hook import hookable, switches_modes

FORMAT = "stagerd.fabric/1"


def is_calling() -> bool:
    """Whether a Fabric strategy is saving or loading through the plugin (not a Trainer's)."""
    from lightning.fabric.strategies import Strategy

    from stagerd.ops.call_stack import calling_self

    return calling_self(Strategy) is not None  # type: ignore[type-abstract]  # an isinstance check only


def step_of(state: Mapping[str, Any], step_key: str, path: Any) -> int:
    step = state.get(step_key)
    if isinstance(step, bool) or not isinstance(step, int):
        raise ConfigError(
            f"fabric.save's state holds no int step under {step_key!r}",
            path=path,
            hint="put the step in the state (state['step'] = step), or name its key with "
            "StagerdCheckpointIO(..., step_key='iteration')",
        )
    return int(step)


def model_key(state: Mapping[str, Any], model: Any, path: Any) -> str:
    """The state's entry that is the model's state dict."""
    flat = [k for k, v in state.items() if _flat_tensors(v)]
    if model is not None:  # its entry: its own tensors (the state dict shares their storage)
        own = unwrapped(model).state_dict()
        flat = [k for k in flat if set(state[k]) == set(own) and _same_storage(state[k], own)]
    if len(flat) != 1:
        which = "the state dict of model=" if model is not None else "one flat dict of tensors"
        raise ConfigError(
            f"fabric.save's state holds {len(flat)} entries that are {which}: which is the model is unknown",
            path=path,
            hint="give the module passed to fabric.setup as StagerdCheckpointIO(..., model=model)",
        )
    return flat[0]


def unwrapped(model: Any) -> Any:
    """The user's module inside Fabric's `_FabricModule` and `torch.compile`'s wrapper: Fabric's state
    holds its state dict, with no `_orig_mod.`."""
    from lightning.fabric.wrappers import _FabricModule

    return uncompiled(model.module if isinstance(model, _FabricModule) else model)


def attach_to(model: Any) -> list[torch.optim.Optimizer] | None:
    """The torch optimizers of the calling `fabric.save`'s state whose next step is to wait for the save's
    copy; None when the save must wait for it itself. `model`: the module the Stager is given (its
    buffers are copied before the save returns)."""
    given = _state_given()
    if given is None:
        return None
    try:
        optimizers = [hookable(o) for o in given.values() if isinstance(o, torch.optim.Optimizer)]
    except ConfigError:  # a step that runs no optimizer hooks would not wait
        return None
    if not optimizers or any(switches_modes(o) for o in optimizers):
        return None
    copied_now = _buffer_storages(model) if isinstance(model, torch.nn.Module) else set()
    for module in (m for m in given.values() if isinstance(m, torch.nn.Module)):
        buffers = _buffer_storages(module) - copied_now
        for t in module.state_dict().values():  # the saved ones (a non-persistent buffer is not)
            if _storage(t) in buffers and t.untyped_storage().nbytes() > EAGER_MAX_BYTES:
                return None  # copied in the background, a forward may change it before the step
    return optimizers


def _state_given() -> Mapping[str, Any] | None:
    """The state given to the calling `Fabric.save`, its modules and optimizers the objects inside
    Fabric's wrappers; None when the save did not come through it (the strategy called directly)."""
    from lightning.fabric import Fabric
    from lightning.fabric.wrappers import _unwrap_objects

    frame: Any = sys._getframe(1)
    while frame is not None:
        if frame.f_code is Fabric.save.__code__ and isinstance(frame.f_locals.get("self"), Fabric):
            state = frame.f_locals.get("state")
            return _unwrap_objects(dict(state)) if isinstance(state, Mapping) else None
        frame = frame.f_back
    return None


def _buffer_storages(module: torch.nn.Module) -> set[tuple[int, torch.device]]:
    return {_storage(b) for b in module.buffers()}


def _storage(t: torch.Tensor) -> tuple[int, torch.device]:
    return t.untyped_storage().data_ptr(), t.device


def _same_storage(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> bool:
    return all(v.data_ptr() == b[k].data_ptr() for k, v in a.items())


def _flat_tensors(value: Any) -> bool:
    return (
        isinstance(value, Mapping)
        and bool(value)
        and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in value.items())
    )
