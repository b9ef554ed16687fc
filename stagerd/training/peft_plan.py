"""The adapter-only artefact of a PEFT model: what `PeftModel.save_pretrained` writes, planned at save time.

PEFT saves only the adapter's tensors, under its own names (`get_peft_model_state_dict`: the adapter name
removed, `...lora_A.default.weight` -> `...lora_A.weight`), beside `adapter_config.json`. That function runs
here on traced meta tensors (`trace.traced_plan`), so the renames are PEFT's own; the result is a
second to-Hub plan (`adapter_plan` in the marker) that the export carries out into `export/adapter/`
(`adapter_model.safetensors`). The config is written as PEFT writes it (inference mode, the base model's
name or the auto mapping) into the step's extras as `adapter/adapter_config.json`.

The main export is the merged model (`merged_plan`): what `save_pretrained` of `merge_and_unload()`
writes, its LoRA merges declared in the plan and computed by the export engine (`engine/merge.py`).
"""

from __future__ import annotations

import contextlib
import copy
import re
import sys
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from stagerd.contract.hub_plan import HubPlan
from stagerd.contract.lora_merge import ExpertLayout, LoraMerge, MergeKind, marker_list
from stagerd.errors import HubPlanError
from stagerd.training.hf_config_files import merged_module, merged_parameters
from stagerd.training.peft_tokens import ADAPTER, DELTA, row_parts, token_rows, unwrapped_paths
from stagerd.training.trace import resolve as trace
from stagerd.training.trace.resolve import traced_plan

ADAPTER_CONFIG = "adapter/adapter_config.json"
DEFAULT = "default"  # the adapter PEFT saves at the root of its folder


def is_peft_model(model: Any) -> bool:
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


def exported_adapter(model: Any) -> str | None:
    """The adapter `export/adapter/` holds: the model's one adapter or, among several, `default`, which
    `PeftModel.save_pretrained` writes at its root (the others go to subfolders, not exported); None
    where there is no `default` among several."""
    adapters = list(model.peft_config)
    if len(adapters) == 1:
        return adapters[0]
    return DEFAULT if DEFAULT in adapters else None


def adapter_plan(
    model: Any, sd: Mapping[str, torch.Tensor], aliases: Mapping[str, str], name: str
) -> tuple[HubPlan, bytes]:
    """The plan of adapter `name`'s `adapter_model.safetensors` and the bytes of its `adapter_config.json`."""
    from peft.utils.save_and_load import get_peft_model_state_dict

    def convert(meta: dict[str, torch.Tensor]) -> Mapping[str, Any]:
        return get_peft_model_state_dict(model, state_dict=meta, adapter_name=name)

    plan = traced_plan(sd, aliases, convert, "peft")
    if not plan.views:
        raise HubPlanError(f"the PEFT model's adapter {name!r} has no tensors in the state dict")
    return plan, _config_bytes(model, name)


def _config_bytes(model: Any, name: str) -> bytes:
    """adapter_config.json as `PeftModel.save_pretrained` writes it."""
    # Shallow: PEFT writes a set field (`target_modules`) as list(deepcopy(set)), and a set copied twice
    # may iterate in another order than one copied once.
    cfg = copy.copy(model.peft_config[name])
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


_PREFIX = "base_model.model."
_BASE_LAYER = re.compile(r"\.base_layer(?=\.)")


def merged_plan(model: Any, sd: Mapping[str, torch.Tensor], aliases: Mapping[str, str]) -> HubPlan:
    """The main export of a LoRA model: what `save_pretrained` of `model.merge_and_unload()` writes.

    Each LoRA `Linear` or `Embedding` of the one active adapter becomes a `LoraMerge` (its base weight, A,
    B, and PEFT's own `scaling` and `fan_in_fan_out`, so rslora and rank/alpha patterns come as PEFT
    computed them), named as the unwrapped module's weight; other adapters' tensors are left out; every
    other key loses PEFT's `base_model.model.` prefix and `.base_layer`. A module of `modules_to_save` is
    its adapter's trained copy under the module's own name, its original left out; a layer tied to that
    original (a copy of a tied weight without `ensure_weight_tying`) keeps the original's bytes, untied, as
    merge_and_unload() leaves it (its config then says so: `hf_config_files`). The base model's own
    save-time conversion (`trace.transformers_plan`) then runs on those names. A DoRA layer's merge
    also reads its magnitude vector; a LoRA bias (`lora_bias=True`) is a merge of the base layer's bias; a
    parameter of `target_parameters` (a MoE's fused experts) is an `EXPERTS` merge; trainable tokens
    (`trainable_token_indices`) are their rows copied over the embedding's (`peft_tokens`). Anything PEFT
    merges otherwise (convolutions, other LoRA variants) is a HubPlanError."""
    from peft.tuners.lora.layer import LoraLayer

    adapters, active = list(model.peft_config), list(model.active_adapters)
    if len(active) != 1 or model.peft_config[active[0]].peft_type.value != "LORA":
        raise HubPlanError(f"a merged export needs one active LoRA adapter, this model has {active}")
    name = active[0]
    keys = [*sd, *aliases]
    # merge_and_unload() merges the active adapter and drops every adapter's own tensors
    others = {k for k in keys if ".lora_" in k and any(f".{o}." in f"{k}." for o in adapters if o != name)}
    staged = {k: aliases.get(k, k) for k in keys}
    merges: list[LoraMerge] = []
    consumed: set[str] = set()
    tied = set(aliases.values())
    saved = _modules_to_save(model, name)
    tokens = token_rows(model, name, sd, staged)
    # merge_and_unload() puts each trainable-tokens wrapper's base layer, its rows merged, in its place
    saved |= unwrapped_paths(model)
    consumed.update(t.consumed for t in tokens)
    others |= {k for k in keys if f".{DELTA}." in k and not k.endswith(f".{DELTA}.{name}")}
    for mname, mod in model.named_modules():
        if not isinstance(mod, LoraLayer) or name not in mod.scaling:
            continue
        for m in _layer_merges(mod, mname, name):
            if not all(k in staged for k in m.inputs):
                raise HubPlanError(
                    f"{mname!r}: its base layer or a LoRA tensor of it is not in the state dict"
                )
            if m.base in aliases or m.base in tied:
                # merge_and_unload() merges into the one shared weight: the tied layer changes too (twice
                # with ensure_weight_tying=True, whose tied layer merges the same delta again)
                raise HubPlanError(
                    f"{mname!r}: LoRA on a tied weight, which merge_and_unload() merges into the layer tied"
                    " to it too"
                )
            consumed.update(m.inputs)
            on = staged.get  # a tied key reads its original; "" (a bias merge's A, no magnitude) stays
            merges.append(
                replace(m, base=on(m.base, ""), a=on(m.a, ""), b=on(m.b, ""), magnitude=on(m.magnitude, ""))
            )
    # In the marker's order of kinds: it lists them apart, and a plan reads back in that order.
    merges.sort(key=lambda m: marker_list(m.kind))
    if not merges:
        raise HubPlanError(f"the PEFT model's adapter {name!r} has no LoRA Linear layer to merge")
    if any(m.name in sd for m in merges):
        raise HubPlanError("a merged weight's name is already a saved key")
    # The merged model's state dict, under the unwrapped names: merged tensors, then the rest renamed.
    src_of: dict[str, str] = {m.name: m.name for m in merges}
    sd2: dict[str, torch.Tensor] = {m.name: sd[m.base] for m in merges}
    aliases2: dict[str, str] = {}
    untied: dict[str, str] = {}  # a staged key merge_and_unload() drops -> the first kept key tied to it
    for k in keys:
        n = _merged_name(k, saved)
        if k in consumed or k in others or n is None:
            continue
        if ".lora_" in k:
            raise HubPlanError(f"{k!r}: a LoRA tensor of no merged layer")
        if n in src_of:
            raise HubPlanError(f"{k!r} and another key both become {n!r} once merged")
        src = aliases.get(k)
        if src is None:
            src_of[n], sd2[n] = k, sd[k]
            continue
        if src in consumed:
            raise HubPlanError(f"{k!r} is tied to {src!r}, which the merge changes")
        kept = _merged_name(src, saved) or untied.get(src)
        if kept is not None:
            aliases2[n] = kept
        else:
            # Tied to a modules_to_save wrapper's original (a copy of a tied weight without
            # ensure_weight_tying): merge_and_unload() leaves this layer on the original, untied.
            untied[src] = n
            src_of[n], sd2[n] = src, sd[src]
    base = model.get_base_model()
    # merge_and_unload() puts each base layer where its LoRA layer was, and drops the LoRA matrices
    keys = [_unwrapped(k) for k in base.state_dict(keep_vars=True) if ".lora_" not in k]
    keys = [n for k in keys if (n := _merged_name(k, saved)) is not None]
    parameters = sum(p.numel() for p in merged_parameters(base))  # merge_and_unload()'s num_parameters()
    with _params_unwrapped(base):
        plan = trace.transformers_plan(base, sd2, aliases2, keys=keys, parameters=parameters)
    shapes = {n: tuple(t.shape) for n, t in sd2.items()}
    zeros = {z.name: z.shape for z in plan.zeros}  # a conversion's padding: read by its own name
    rows = {_merged_name(t.base, saved): t for t in tokens}
    views = []
    for v in plan.outputs({**shapes, **zeros}):
        if v.source in rows:
            views += row_parts(v, rows[v.source], shapes[v.source])
        else:
            views.append(v if v.source in zeros else replace(v, source=src_of[v.source]))
    drop = [src_of[n] for n in plan.drop]
    drop += [k for k in sd if k in others or (k not in consumed and _merged_name(k, saved) is None)]
    if any(n in src_of and src_of[n] == n for n in plan.drop):
        raise HubPlanError("save_pretrained leaves out a merged LoRA weight: not planned")
    # Keys the merged model does not hold (only aliases of consumed keys here): none is written. A cast of
    # token rows is read only by their parts: last, in the marker's order of kinds.
    merges += [t.cast for t in tokens if t.cast is not None]
    return replace(plan, views=tuple(views), drop=tuple(drop), origin="peft", merges=tuple(merges))


def _layer_merges(mod: Any, mname: str, name: str) -> list[LoraMerge]:
    """The merges of adapter `name` in the LoRA layer `mname`, on its own keys, as its `merge` computes
    them: the weight (plain LoRA or DoRA, its magnitude vector read too) and, with `lora_bias`, the bias."""
    from peft.tuners.lora.layer import Embedding as LoraEmbedding
    from peft.tuners.lora.layer import Linear as LoraLinear
    from peft.tuners.lora.layer import ParamWrapper
    from peft.tuners.lora.variants import DoraEmbeddingVariant, DoraLinearVariant

    if type(mod) is ParamWrapper:
        return [_param_merge(mod, mname, name)]
    kind, variant = type(mod), mod.lora_variant.get(name)
    dora = isinstance(variant, DoraLinearVariant | DoraEmbeddingVariant)
    if kind not in (LoraLinear, LoraEmbedding) or (variant is not None and not dora):
        raise HubPlanError(f"{mname!r}: only LoRA and DoRA Linear and Embedding layers are merged")
    base, scaling = f"{mname}.base_layer.weight", float(mod.scaling[name])
    if kind is LoraEmbedding:  # PEFT's delta is (B @ A).T: an (embeddings x dim) weight is in x out
        a, b = (f"{mname}.lora_embedding_{p}.{name}" for p in "AB")
        # its merge casts the delta to the base's dtype before adding it (its DoRA variant does not)
        weight = LoraMerge(_unwrapped(base), base, a, b, scaling, fan_in_fan_out=True, delta_to_base=not dora)
    else:
        a, b = (f"{mname}.lora_{p}.{name}.weight" for p in "AB")
        weight = LoraMerge(_unwrapped(base), base, a, b, scaling, bool(getattr(mod, "fan_in_fan_out", False)))
    if dora:
        weight = replace(
            weight, kind=MergeKind.DORA, magnitude=f"{mname}.lora_magnitude_vector.{name}.weight"
        )
    if not mod.lora_bias.get(name):
        return [weight]
    if getattr(mod.get_base_layer(), "bias", None) is None:
        raise HubPlanError(f"{mname!r}: a LoRA bias on a layer without one, which PEFT cannot merge")
    bias = f"{mname}.base_layer.bias"
    lora_b = f"{mname}.lora_B.{name}.bias"
    return [weight, LoraMerge(_unwrapped(bias), bias, "", lora_b, scaling, kind=MergeKind.BIAS)]


def _param_merge(mod: Any, mname: str, name: str) -> LoraMerge:
    """The merge of adapter `name` into the parameter the `ParamWrapper` `mname` adapts, as its `merge`
    computes it: per expert, PEFT's einsum of A and B reshaped by expert."""
    n, param = int(mod.num_experts), mod.get_param()
    layout = ExpertLayout.EOI if mod._did_swap_in_out_features or param.dim() == 2 else ExpertLayout.EIO
    if mod.lora_variant.get(name) is not None or mod.lora_bias.get(name) or mod.fan_in_fan_out:
        raise HubPlanError(f"{mname!r}: only plain LoRA on a parameter of target_parameters is merged")
    if param.dim() not in (2, 3) or (n == 1 and layout is ExpertLayout.EIO):
        # PEFT merges one expert as a Linear, out x in: it does not fit an [1, in, out] parameter.
        raise HubPlanError(f"{mname!r}: a {list(param.shape)} parameter is not one PEFT merges by expert")
    # Targeting two parameters of one module nests the wrappers: the parameter is under each's base_layer.
    inner, depth = mod, 0
    while hasattr(inner, "base_layer"):
        inner, depth = inner.base_layer, depth + 1
    base = f"{mname}{'.base_layer' * depth}.{mod.parameter_name}"
    a, b = (f"{mname}.lora_{p}.{name}.weight" for p in "AB")
    scaling = float(mod.scaling[name])
    return LoraMerge(_unwrapped(base), base, a, b, scaling, kind=MergeKind.EXPERTS, experts=n, layout=layout)


@contextlib.contextmanager
def _params_unwrapped(base: Any) -> Iterator[None]:
    """The base model with each `ParamWrapper`, `TrainableTokensWrapper` and `ModulesToSaveWrapper`
    replaced by the module merge_and_unload() puts in its place: transformers' conversion looks its
    parameters and buffers up by their merged names (`experts.down_proj`, `embed_tokens.weight`, a
    router copy's `gate.e_score_correction_bias`), which a wrapper, unlike a LoRA Linear's `weight`, does
    not answer. Nothing runs on the model meanwhile."""
    from peft.tuners.lora.layer import ParamWrapper
    from peft.utils.other import ModulesToSaveWrapper, TrainableTokensWrapper

    swapped: list[tuple[Any, str, Any]] = []
    for parent in list(base.modules()):
        if isinstance(parent, ParamWrapper):
            continue  # a nested wrapper goes with its outermost one
        for attr, child in list(parent.named_children()):
            if isinstance(child, ParamWrapper):
                swapped.append((parent, attr, child))
                setattr(parent, attr, child.get_base_layer())
            elif isinstance(child, TrainableTokensWrapper):
                swapped.append((parent, attr, child))
                setattr(parent, attr, getattr(child, ADAPTER).get_base_layer())
            elif isinstance(child, ModulesToSaveWrapper):
                swapped.append((parent, attr, child))
                setattr(parent, attr, merged_module(child))
    try:
        yield
    finally:
        for parent, attr, child in reversed(swapped):
            setattr(parent, attr, child)


def _modules_to_save(model: Any, name: str) -> dict[str, str]:
    """Each `modules_to_save` wrapper's path in the base model -> the path of the copy merge_and_unload()
    puts in its place (`lm_head` -> `lm_head.modules_to_save.default`): the adapter's trained copy."""
    from peft.utils.other import ModulesToSaveWrapper

    out: dict[str, str] = {}
    for mname, mod in model.named_modules():
        if not isinstance(mod, ModulesToSaveWrapper):
            continue
        copies = mod.modules_to_save  # a ModuleDict: no `get`
        if mod.active_adapter != name or name not in copies or hasattr(copies[name], "base_layer"):
            raise HubPlanError(f"{mname!r}: only a modules_to_save copy of the active adapter is merged")
        path = mname.removeprefix(_PREFIX)
        out[path] = f"{path}.modules_to_save.{name}"
    return out


def _merged_name(key: str, saved: Mapping[str, str]) -> str | None:
    """`key`'s name in merge_and_unload()'s model (see `_unwrapped`), or None for a key it drops: a
    modules_to_save wrapper's original module or another adapter's copy."""
    n = _unwrapped(key)
    if f".{DELTA}." in n:  # trainable tokens: merged into their weight, or another adapter's
        return None
    for path, kept in saved.items():
        if n.startswith(f"{kept}."):
            return f"{path}.{n[len(kept) + 1 :]}"
        if n.startswith(f"{path}."):
            return None
    return n


def _unwrapped(key: str) -> str:
    """A staged key's name in `merge_and_unload()`'s model: no PEFT prefix, no `.base_layer` (several where
    `target_parameters` nests wrappers)."""
    return _BASE_LAYER.sub("", key.removeprefix(_PREFIX))
