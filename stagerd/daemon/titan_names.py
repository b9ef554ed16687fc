"""The names of a torchtitan checkpoint as `save_pretrained` writes them, planned with torchtitan's own
`StateDictAdapter.to_hf` (what its `last_save_in_hf` runs), where config.json names a model torchtitan
has an adapter for.

`to_hf` runs, unchanged, on traced meta stand-ins of the checkpoint's tensors (global shapes from `.metadata`,
`training/trace/`): its renames, the tied head it leaves out and its split of grouped experts per expert
become the byte moves of a `HubPlan`; any op that is not one is refused by name. The adapter reads from its
model config only whether the head is tied, how many experts a MoE layer has and (DeepSeek V3) whether the
query is low-rank: those are taken from config.json, on a registry flavor of the same kind (dense or MoE).
DeepSeek V3's to_hf is renames and the expert split only: its RoPE rows stay interleaved pairs, as
transformers reads them where config.json says `rope_interleave` (its default); a config.json that says
otherwise, or a checkpoint with multi-token prediction layers (which transformers' model lacks), is refused by
name. The result must be, name for name and shape for shape, what transformers' `save_pretrained` of
config.json's model writes: otherwise (or where torchtitan cannot be imported) the plan is refused, and the
daemon (`hf_names.py`) warns once and lets the preset's own rules decide. Llama 3 keeps those rules (they
permute the RoPE rows as torchtitan's Llama adapter does). The caller holds the daemon's planning lock: one
plan at a time.
"""

from __future__ import annotations

import copy
import importlib
import importlib.util
import sys
import types
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from stagerd.contract.hub_plan import HubPlan
from stagerd.daemon.meta_models import Tensors, Uncast, model_classes, saved_outputs, stand_ins
from stagerd.errors import HubPlanError

# config.json's model_type -> (torchtitan's model package, a registry flavor of the same kind)
TITAN_MODELS: dict[str, tuple[str, str]] = {
    "qwen3": ("torchtitan.models.qwen3", "debugmodel"),
    "qwen3_moe": ("torchtitan.models.qwen3", "debugmodel_moe"),
    "deepseek_v3": ("torchtitan.models.deepseek_v3", "debugmodel"),
}
# torchtitan's model package imports its expert-parallel dispatch, Triton kernels, on import; see
# `stand_in_ep_kernels`.
_EP = "torchtitan.distributed.minimal_async_ep"


def titan_plan(tensors: Tensors, config: Mapping[str, Any]) -> HubPlan | None:
    """The plan over the checkpoint's torchtitan names that gives `save_pretrained`'s, or None for a model
    torchtitan has no adapter for here. Raises where it has one but the plan cannot be made (the caller
    warns and lets the preset's rules decide)."""
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or model_type not in TITAN_MODELS:
        return None
    return _plan(tensors, config, model_type)


def stand_in_ep_kernels() -> None:
    """Where triton is not installed (a CPU daemon), torchtitan's expert-parallel dispatch module, which
    imports it, is stood in by one whose functions refuse to run: converting names never dispatches."""
    if _EP in sys.modules or importlib.util.find_spec("triton") is not None:
        return

    def absent(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("torchtitan's MinimalAsyncEP needs triton, which is not installed")

    for name in (_EP, f"{_EP}.api"):
        m = types.ModuleType(name)
        m.combine_op = m.dispatch_op = m.init_buffer = m.maybe_update_minimal_async_ep_config = absent  # type: ignore[attr-defined]
        m.MinimalAsyncEPDispatchMetadata = type("MinimalAsyncEPDispatchMetadata", (), {})  # type: ignore[attr-defined]
        sys.modules[name] = m


def _plan(tensors: Tensors, config: Mapping[str, Any], model_type: str) -> HubPlan:
    from stagerd.training.trace.resolve import traced_plan

    _refuse_deepseek_v3(tensors, config, model_type)
    package, flavor = TITAN_MODELS[model_type]
    stand_in_ep_kernels()
    titan = importlib.import_module(package)
    spec = titan.model_registry(flavor)
    model_config = _model_config(spec.model, config)
    adapter = spec.state_dict_adapter(model_config, None)
    sd = stand_ins(tensors)
    plan = traced_plan(sd, {}, adapter.to_hf, "torchtitan")
    got = {v.name: tuple(v.shape) for v in plan.outputs({k: tuple(v.shape) for k, v in sd.items()})}
    order, want, parameters, uncast = _saved(config)
    if got != want:
        extra, lacks = sorted(set(got) - set(want)), sorted(set(want) - set(got))
        shapes = sorted(n for n in set(got) & set(want) if got[n] != want[n])
        raise HubPlanError(
            f"to_hf does not give what save_pretrained writes (extra {extra[:3]}, lacking {lacks[:3]}, "
            f"other shapes {shapes[:3]})"
        )
    # under a cast, what transformers keeps in float32 (DeepSeek V3's router), by save_pretrained's names
    return replace(plan, order=tuple(n for n in order if n in got), parameters=parameters, uncast=uncast)


def _refuse_deepseek_v3(tensors: Tensors, config: Mapping[str, Any], model_type: str) -> None:
    """What DeepSeek V3's to_hf gives by byte moves that transformers' model would not compute with."""
    if model_type != "deepseek_v3":
        return
    if config.get("rope_interleave", True) is False:
        # the rows would need reordering within each head's RoPE part, which to_hf does not do
        raise HubPlanError(
            "config.json says rope_interleave false, but torchtitan's RoPE rows are interleaved pairs"
        )
    if any(n.startswith("mtp_layers.") for n in tensors):
        # to_hf numbers them on after the main layers; transformers' DeepseekV3ForCausalLM has none
        raise HubPlanError(
            "torchtitan's multi-token prediction layers (mtp_layers.*) are not in what save_pretrained writes"
        )


def _model_config(flavor: Any, config: Mapping[str, Any]) -> Any:
    """The flavor's model config with what `to_hf` reads of it taken from config.json."""
    out = copy.deepcopy(flavor)
    out.enable_weight_tying = bool(config.get("tie_word_embeddings", False))
    # the Hub's Qwen3-MoE configs say num_experts, transformers 5 writes num_local_experts; DeepSeek V3's
    # say n_routed_experts
    experts = next(
        (config[k] for k in ("num_experts", "num_local_experts", "n_routed_experts") if k in config), None
    )
    for layer in out.layers:
        if getattr(layer, "moe", None) is not None:
            if not _count(experts):
                raise HubPlanError(f"a MoE model whose config.json gives no num_experts ({experts!r:.40})")
            layer.moe.num_experts = experts
        # DeepSeek V3's MLA: a low-rank query (wq_a, q_norm, wq_b) or one projection (wq), by q_lora_rank
        if hasattr(getattr(layer, "attention", None), "q_lora_rank"):
            rank = config.get("q_lora_rank") or 0
            if rank != 0 and not _count(rank):
                raise HubPlanError(f"config.json's q_lora_rank is {rank!r:.40}, not a positive whole number")
            layer.attention.q_lora_rank = rank
    return out


def _count(n: object) -> bool:
    """A positive whole number: JSON's `true` is an int to Python, and torchtitan fails on it unexplained."""
    return isinstance(n, int) and not isinstance(n, bool) and n > 0


def _saved(config: Mapping[str, Any]) -> tuple[list[str], dict[str, tuple[int, ...]], int, Uncast]:
    """What `save_pretrained` of config.json's model writes (`meta_models.saved_outputs`)."""
    classes = model_classes(config)
    if not classes:
        raise HubPlanError(f"transformers has no model for model_type {config['model_type']!r}")
    return saved_outputs(classes[0], config)
