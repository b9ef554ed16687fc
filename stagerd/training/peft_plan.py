"""The adapter-only artefact of a PEFT model: what `PeftModel.save_pretrained` writes, planned at save time.

PEFT saves only the adapter's tensors, under its own names (`get_peft_model_state_dict`: the adapter name
removed, `...lora_A.default.weight` -> `...lora_A.weight`), beside `adapter_config.json`. That function runs
here on traced meta tensors (`hub_trace.traced_plan`), so the renames are PEFT's own; the result is a
second to-Hub plan (`adapter_plan` in the marker) that the export carries out into `export/adapter/`
(`adapter_model.safetensors`). The config is written as PEFT writes it (inference mode, the base model's
name or the auto mapping) into the step's extras as `adapter/adapter_config.json`.
"""

from __future__ import annotations

import copy
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from stagerd.contract.hub_plan import HubPlan
from stagerd.errors import HubPlanError
from stagerd.training.hub_trace import traced_plan

ADAPTER_CONFIG = "adapter/adapter_config.json"


def is_peft_model(model: Any) -> bool:
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


def adapter_plan(
    model: Any, sd: Mapping[str, torch.Tensor], aliases: Mapping[str, str]
) -> tuple[HubPlan, bytes]:
    """The plan of `adapter_model.safetensors` and the bytes of `adapter_config.json`."""
    from peft.utils.save_and_load import get_peft_model_state_dict

    adapters = list(model.peft_config)
    if len(adapters) != 1:
        raise HubPlanError(f"a PEFT model with one adapter can be exported as one, this one has {adapters}")
    name = adapters[0]

    def convert(meta: dict[str, torch.Tensor]) -> Mapping[str, Any]:
        return get_peft_model_state_dict(model, state_dict=meta, adapter_name=name)

    plan = traced_plan(sd, aliases, convert, "peft")
    if not plan.views:
        raise HubPlanError(f"the PEFT model's adapter {name!r} has no tensors in the state dict")
    return plan, _config_bytes(model, name)


def _config_bytes(model: Any, name: str) -> bytes:
    """adapter_config.json as `PeftModel.save_pretrained` writes it."""
    cfg = copy.deepcopy(model.peft_config[name])
    if cfg.base_model_name_or_path is None:
        base = model.base_model if cfg.is_prompt_learning else model.base_model.model
        cfg.base_model_name_or_path = base.__dict__.get("name_or_path", None) or None
    cfg.inference_mode = True
    auto = None
    if cfg.task_type is None:
        cls = model._get_base_model_class(is_prompt_tuning=cfg.is_prompt_learning)
        auto = {"base_model_class": cls.__name__, "parent_library": cls.__module__}
    with tempfile.TemporaryDirectory() as d:
        cfg.save_pretrained(d, auto_mapping_dict=auto)
        return (Path(d) / "adapter_config.json").read_bytes()
