"""`StagerdCheckpointIO` under Lightning Fabric: `fabric.save(path, state)` and `fabric.load(path, state)`
through the same plugin, the loop unchanged.

Fabric hands the plugin the user's own state with each module and optimizer turned into its state dict:
`{"model": {...}, "optimizer": {...}, "step": 100}`. The step is the int under the plugin's `step_key`
("step" unless told); the model is the entry holding the state dict of `model=` (its tensors), or without
`model=` the one entry that is a flat dict of tensors. That entry is the step's model (exported as the
Trainer's plugin exports `model=`), everything else goes through `state_tree` into `optim/`, and `read`
gives the state back as Fabric's own file would hold it, no pickle. Fabric saves from global rank 0 alone,
as the Trainer's DDP does; the save waits for its host copy (no optimizer step is known to wait for it).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from stagerd.errors import ConfigError

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

    model = model.module if isinstance(model, _FabricModule) else model
    while isinstance(getattr(model, "_orig_mod", None), torch.nn.Module):
        model = model._orig_mod
    return model


def _same_storage(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> bool:
    return all(v.data_ptr() == b[k].data_ptr() for k, v in a.items())


def _flat_tensors(value: Any) -> bool:
    return (
        isinstance(value, Mapping)
        and bool(value)
        and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in value.items())
    )
