"""What a save's export will be, decided at save time from the `model` handed to `Stager.save`.

- a transformers model: `save_pretrained`'s names and layout (`trace.transformers_plan`);
- a PEFT LoRA model: the merged model as `save_pretrained` of `merge_and_unload()` writes it (LoRA merges
  the engine computes, DoRA, LoRA biases and a MoE's fused experts included), plus the adapter-only
  artefact (`peft_plan`); a model PEFT would merge otherwise (convolutions, ...) keeps its keys as staged,
  with a warning;
- a declarative key `mapping` (`contract/key_mapping.py`; torchtitan and other trainers): its renames,
  splits and RoPE permutations;
- a module that holds one transformers model (a LightningModule, a wrapper): that model's export, its keys
  found under their prefix in the module's state dict; the module's other keys are not exported;
- no model, but `extras["config.json"]` of a transformers architecture: the model it describes, built
  once on the meta device (`config_model`), so a user who gives the config gets what `save_pretrained`
  writes too; where that model cannot be found, a warning (once) that names `model=`;
- anything else: every key as staged, tied duplicates with their own bytes.
"""

from __future__ import annotations

import json
import logging
import warnings
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch

from stagerd.contract.hub_plan import HubPlan, TensorView
from stagerd.contract.key_mapping import KeyMapping
from stagerd.errors import HubPlanError
from stagerd.training import config_model, peft_plan
from stagerd.training.hf_config_files import saved_config_files
from stagerd.training.trace import resolve as trace

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ToHub:
    """The marker's plans, and extras the plans need (name -> bytes)."""

    plan: HubPlan | None = None
    adapter: HubPlan | None = None
    extras: tuple[tuple[str, bytes], ...] = ()


def resolve(
    model: Any,
    sd: Mapping[str, torch.Tensor],
    aliases: Mapping[str, str],
    mapping: Any = None,
    config: Any = None,
    given: frozenset[str] = frozenset(),
) -> ToHub:
    """`config`: the save's `extras["config.json"]` (a dict, JSON bytes or a path), or None; `given`: the
    names of the save's extras. A transformers model's config files that are not given are written as
    its save_pretrained writes them."""
    if mapping is not None:
        if model is not None:
            raise HubPlanError("pass model= or mapping=, not both: each decides the export's names")
        return ToHub(mapping_plan(KeyMapping.load(mapping), sd, aliases))
    model = _outside_compile(model, [*sd, *aliases])
    if model is not None and not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise HubPlanError("model= needs a flat state dict of tensors, as model.state_dict() gives")
    if model is not None and peft_plan.is_peft_model(model):
        adapter: HubPlan | None = None
        config_file: tuple[tuple[str, bytes], ...] = ()
        name = peft_plan.exported_adapter(model)
        if name is not None:
            adapter, adapter_config = peft_plan.adapter_plan(model, sd, aliases, name)
            config_file = ((peft_plan.ADAPTER_CONFIG, adapter_config),)
        if len(model.peft_config) > 1:  # a reference adapter beside the trained one, say: the save goes on
            left = [a for a in model.peft_config if a != name]
            log.warning("the export's adapter/ holds %s; the adapters %s are not exported", name, left)
        main: HubPlan | None
        try:
            main = peft_plan.merged_plan(model, sd, aliases)
        except HubPlanError as e:  # the adapter still exports; the main export keeps PEFT's names
            log.warning("the export keeps the PEFT model's own names, unmerged: %s", e.message)
            main = trace.alias_plan(sd, aliases)
        base = saved_config_files(model.get_base_model(), given)  # what merge_and_unload() saves
        return ToHub(main, adapter, (*config_file, *base))
    if model is not None and trace.is_transformers_model(model):
        plan = _exporting(trace.transformers_plan(model, sd, aliases), sd)
        return ToHub(plan, extras=saved_config_files(model, given))
    inner = config_model.inner_model(model) if model is not None else None
    if inner is not None:
        plan = _exporting(prefixed_plan(inner, sd, aliases), sd)
        return ToHub(plan, extras=saved_config_files(inner.model, given))
    flat = all(isinstance(v, torch.Tensor) for v in sd.values())
    cfg = config_model.config_dict(config) if config is not None and flat else None
    found = config_model.from_config(cfg, [*sd, *aliases]) if cfg is not None else None
    if found is not None:
        try:
            if isinstance(found, config_model.Found):
                return ToHub(prefixed_plan(found, sd, aliases))
        except HubPlanError as e:
            found = e.message
        warn_once(
            f"the export keeps the state dict's own names, not what save_pretrained writes: {found}",
            "pass the model to Stager.save(..., model=model)",
        )
    return ToHub(trace.alias_plan(sd, aliases))


def _outside_compile(model: Any, keys: list[str]) -> Any:
    """The model inside `torch.compile`'s wrapper where the saved keys are its own: `model.state_dict()`
    of a compiled model carries `_orig_mod.`, `get_model_state_dict`'s does not."""
    return model if any(k.startswith("_orig_mod.") for k in keys) else config_model.uncompiled(model)


def _exporting(plan: HubPlan, sd: Mapping[str, torch.Tensor]) -> HubPlan:
    """`plan`, unless it exports none of the saved tensors: `model=` is then not the model they are of."""
    if sd and not plan.views and set(sd) <= set(plan.drop):
        raise HubPlanError(
            "model= exports none of the saved tensors: their keys are not the model's",
            hint="pass the state dict of the model given as model= (its state_dict(), get_model_state_dict)",
        )
    return plan


class PlanCache:
    """The last save's plan, reused by the next save of the same model, config and set of tensors: a
    training resolves it once.

    The model is held weakly and compared by identity, not by `id()`: a new model in a freed one's
    memory has its `id` and may have its tensors, but not its plan."""

    def __init__(self) -> None:
        self._last: tuple[Callable[[], Any], tuple[Any, ...], ToHub] | None = None  # (model, key, plan)

    def get(
        self,
        model: Any,
        sd: Mapping[str, Any],
        aliases: Mapping[str, str],
        mapping: Any,
        config: Any,
        given: frozenset[str] = frozenset(),
    ) -> ToHub:
        key = (
            repr(config),
            tuple(sorted(given)),
            json.dumps(mapping, sort_keys=True) if isinstance(mapping, Mapping) else str(mapping),
            tuple((k, v.shape, v.dtype) if isinstance(v, torch.Tensor) else (k,) for k, v in sd.items()),
            tuple(aliases.items()),
        )
        last = self._last
        if last is not None and last[1] == key and last[0]() is model:
            return last[2]
        plan = resolve(model, sd, aliases, mapping, config, given)
        self._last = (_held(model), key, plan)
        return plan


def _held(model: Any) -> Callable[[], Any]:
    """`model` held weakly where it can be (a module can), so a cached plan keeps no model alive."""
    try:
        return weakref.ref(model)
    except TypeError:  # None, or an object without weak references: held as is
        return lambda: model


_warned: set[str] = set()


def warn_once(message: str, hint: str) -> None:
    """One warning per distinct message in a process: later saves of the same training say nothing new."""
    if message not in _warned:
        _warned.add(message)
        warnings.warn(f"{message}; {hint}", UserWarning, stacklevel=4)


def prefixed_plan(
    found: config_model.Found, sd: Mapping[str, torch.Tensor], aliases: Mapping[str, str]
) -> HubPlan:
    """The transformers plan of `found.model`, whose keys are the staged keys under `found.prefix`.

    The conversion runs on the model's own names; every view then reads the prefixed staged key, a key
    the conversion passes through unchanged is renamed to its model name, and the staged keys outside
    the model are not exported. A tied key of the model whose twin lies outside it reads that twin."""
    p = found.prefix
    if not p:
        return trace.transformers_plan(found.model, sd, aliases)
    staged_of = {k[len(p) :]: k for k in sd if k.startswith(p)}
    sub_aliases: dict[str, str] = {}
    for dup, src in aliases.items():
        if not dup.startswith(p):
            continue
        if src.startswith(p):
            sub_aliases[dup[len(p) :]] = src[len(p) :]
        else:
            staged_of[dup[len(p) :]] = src
    sub_sd = {k: sd[staged] for k, staged in staged_of.items()}
    plan = trace.transformers_plan(found.model, sub_sd, sub_aliases)
    zeros = {z.name for z in plan.zeros}  # a zero fill is read by its own name
    views = [v if v.source in zeros else replace(v, source=staged_of[v.source]) for v in plan.views]
    read, dropped = {v.source for v in plan.views}, set(plan.drop)
    for k, staged in staged_of.items():
        if k not in read and k not in dropped:
            shape = tuple(sd[staged].shape)
            views.append(TensorView(k, staged, (0,) * len(shape), shape, shape))
    outside = [k for k in sd if not k.startswith(p)]
    drop = [staged_of[k] for k in plan.drop if staged_of[k].startswith(p)]
    # the outputs keep the model's names: its order, shared storages and parameter count hold as they are
    return replace(plan, views=tuple(views), drop=tuple(dict.fromkeys([*drop, *outside])))


def mapping_plan(mapping: KeyMapping, sd: Mapping[str, torch.Tensor], aliases: Mapping[str, str]) -> HubPlan:
    """The mapping applied to every key the trainer saved, a tied duplicate reading its staged twin."""
    shapes = {k: tuple(sd[aliases.get(k, k)].shape) for k in [*sd, *aliases]}
    plan = mapping.resolve(shapes)
    views = tuple(
        TensorView(v.name, aliases.get(v.source, v.source), v.start, v.size, v.shape, v.reshape, v.perm)
        for v in plan.outputs(shapes)
    )
    return HubPlan(views, (), origin=plan.origin)
