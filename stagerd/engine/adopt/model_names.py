"""An adopted checkpoint's names as `save_pretrained` writes them, where its config.json names the model.

A trainer's DCP checkpoint holds the model's live module names. For most models they are the names
`save_pretrained` writes; for some they are not (transformers' conversion registry: a MoE's experts fused
into one 3D tensor per layer, which `save_pretrained` splits back per expert; prefixes a multimodal model
moves). The plan that makes them what `save_pretrained` writes is resolved from transformers' own code by
the training side, which the engine never imports: the daemon hands it in as a `ModelPlan`, and here that
plan, made over the model's names, is turned into one over the checkpoint's keys. Names it plans no
conversion for (kept as the checkpoint has them) get from it what the model keeps in float32 under a
cast (`uncast`), as `from_pretrained` in that dtype keeps it, and the shapes that model has for them
(`shapes`, compared in `config_shapes.py`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any, Protocol

from stagerd.contract.hub_plan import HubPlan, TensorView
from stagerd.engine.adopt.config_shapes import ConfigShapes


class ModelPlan(Protocol):
    """model name -> (global shape, safetensors dtype) of every selected tensor, and config.json: the plan
    over those names that gives what `save_pretrained` writes, or None where the config does not name that
    model. `trainer`: the preset of a trainer whose names are its own, not the model's (torchtitan's),
    whose own conversion to the Hub's names is planned where it has one for config.json's model."""

    def __call__(
        self,
        tensors: Mapping[str, tuple[tuple[int, ...], str]],
        config: Mapping[str, Any],
        trainer: str | None = None,
    ) -> HubPlan | None: ...

    def uncast(
        self, names: Sequence[str], config: Mapping[str, Any], *, casting: bool = False
    ) -> tuple[tuple[str, tuple[str, ...]], ...]:
        """`HubPlan.uncast` over the exported `names` (kept as the checkpoint has them): per cast target,
        those the model config.json names keeps in float32 there; none where it cannot be known (said
        where the export is `casting` to bf16 or fp16)."""
        ...

    def shapes(self, config: Mapping[str, Any]) -> ConfigShapes | None:
        """The shapes the model config.json names has (of the model built for `uncast`, no other), or None
        where it cannot be built here."""
        ...


def over_keys(
    model: HubPlan, chosen: Mapping[str, str], shapes: Mapping[str, tuple[int, ...]]
) -> tuple[list[str], HubPlan]:
    """`model` (a plan over the model's names) over the checkpoint's keys (`chosen`: name -> key, whose
    global shapes `shapes` gives): each view reads its name's key, and a name that no view reads and the
    plan does not drop is written whole, under that name. The keys to read come back with it: a key the
    plan drops (a tied duplicate save_pretrained leaves out) is never read."""
    zeros = {z.name for z in model.zeros}
    views = [v if v.source in zeros else replace(v, source=chosen[v.source]) for v in model.views]
    read, dropped = {v.source for v in model.views}, set(model.drop)
    for name, key in chosen.items():
        if name not in read and name not in dropped:
            shape = tuple(shapes[key])
            views.append(TensorView(name, key, (0,) * len(shape), shape, shape))
    keys = sorted({v.source for v in views if v.source not in zeros})
    plan = replace(model, views=tuple(views), drop=())
    plan.outputs({**{k: tuple(shapes[k]) for k in keys}, **{z.name: z.shape for z in model.zeros}})
    return keys, plan
