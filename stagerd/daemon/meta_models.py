"""An adopted checkpoint's tensors and config.json's model on the meta device (no memory, no
initialisation), for the planners that give its names as `save_pretrained` writes them (`hf_names.py`,
`titan_names.py`): stand-ins of the checkpoint's tensors, and what that model's `save_pretrained` writes.
torch and transformers are imported only when these are called."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from stagerd.contract import dtypes
from stagerd.errors import HubPlanError

Tensors = Mapping[str, tuple[tuple[int, ...], str]]  # name -> (global shape, safetensors dtype)


def stand_ins(tensors: Tensors) -> dict[str, Any]:
    """A meta tensor of each checkpoint tensor's global shape and dtype."""
    import torch

    sd = {}
    for name, (shape, dt) in tensors.items():
        torch_name = dtypes.lookup(dt).torch_name
        if torch_name is None:
            raise HubPlanError(f"{name!r} is {dt}, which torch has no dtype for")
        sd[name] = torch.empty(shape, dtype=getattr(torch, torch_name), device="meta")
    return sd


Uncast = tuple[tuple[str, tuple[str, ...]], ...]  # HubPlan.uncast: (cast target, outputs it leaves as saved)


def saved_outputs(
    cls: Any, config: Mapping[str, Any]
) -> tuple[list[str], dict[str, tuple[int, ...]], int, Uncast]:
    """What `save_pretrained` of `cls` built from `config` writes: its names in order, their shapes, its
    num_parameters() (for the index), and per cast target the names the model keeps in float32 there."""
    import torch
    import transformers as tf

    from stagerd.training.trace.resolve import transformers_plan

    with torch.device("meta"):
        model = cls._from_config(tf.CONFIG_MAPPING[config["model_type"]].from_dict(dict(config)))
    own = model.state_dict()
    plan = transformers_plan(model, own, {})
    shapes = {v.name: tuple(v.shape) for v in plan.outputs({k: tuple(v.shape) for k, v in own.items()})}
    order = [n for n in plan.order if n in shapes] or list(shapes)
    return order, shapes, model.num_parameters(), plan.uncast
