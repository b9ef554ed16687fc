"""What a save's export will be, decided at save time from the `model` handed to `Stager.save`.

- a transformers model: `save_pretrained`'s names and layout (`hub_trace.transformers_plan`);
- a PEFT LoRA model: the merged model as `save_pretrained` of `merge_and_unload()` writes it (LoRA merges
  the engine computes), plus the adapter-only artefact (`peft_plan`); a model PEFT would merge otherwise
  (DoRA, modules_to_save, ...) keeps its keys as staged, with a warning;
- a declarative key `mapping` (`contract/key_mapping.py`; torchtitan and other trainers): its renames,
  splits and RoPE permutations;
- anything else, or no model: every key as staged, tied duplicates with their own bytes.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from stagerd.contract.hub_plan import HubPlan, TensorView
from stagerd.contract.key_mapping import KeyMapping
from stagerd.errors import HubPlanError
from stagerd.training import hub_trace, peft_plan

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ToHub:
    """The marker's plans, and extras the plans need (name -> bytes)."""

    plan: HubPlan | None = None
    adapter: HubPlan | None = None
    extras: tuple[tuple[str, bytes], ...] = ()


def resolve(
    model: Any, sd: Mapping[str, torch.Tensor], aliases: Mapping[str, str], mapping: Any = None
) -> ToHub:
    if mapping is not None:
        if model is not None:
            raise HubPlanError("pass model= or mapping=, not both: each decides the export's names")
        return ToHub(mapping_plan(KeyMapping.load(mapping), sd, aliases))
    if model is not None and not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise HubPlanError("model= needs a flat state dict of tensors, as model.state_dict() gives")
    if model is not None and peft_plan.is_peft_model(model):
        adapter, config = peft_plan.adapter_plan(model, sd, aliases)
        main: HubPlan | None
        try:
            main = peft_plan.merged_plan(model, sd, aliases)
        except HubPlanError as e:  # the adapter still exports; the main export keeps PEFT's names
            log.warning("the export keeps the PEFT model's own names, unmerged: %s", e.message)
            main = hub_trace.alias_plan(sd, aliases)
        return ToHub(main, adapter, ((peft_plan.ADAPTER_CONFIG, config),))
    if model is not None and hub_trace.is_transformers_model(model):
        return ToHub(hub_trace.transformers_plan(model, sd, aliases))
    return ToHub(hub_trace.alias_plan(sd, aliases))


def mapping_plan(mapping: KeyMapping, sd: Mapping[str, torch.Tensor], aliases: Mapping[str, str]) -> HubPlan:
    """The mapping applied to every key the trainer saved, a tied duplicate reading its staged twin."""
    shapes = {k: tuple(sd[aliases.get(k, k)].shape) for k in [*sd, *aliases]}
    plan = mapping.resolve(shapes)
    views = tuple(
        TensorView(v.name, aliases.get(v.source, v.source), v.start, v.size, v.shape, v.reshape, v.perm)
        for v in plan.outputs(shapes)
    )
    return HubPlan(views, (), origin=plan.origin)
