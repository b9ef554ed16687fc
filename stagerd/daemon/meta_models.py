"""An adopted checkpoint's tensors and config.json's model on the meta device (no memory, no
initialisation), for the planners that give its names as `save_pretrained` writes them (`hf_names.py`,
`titan_names.py`): stand-ins of the checkpoint's tensors, what that model's `save_pretrained` writes, and
for names kept as they are what it keeps in float32 under a cast and the shapes it has (one model built
for both). torch and transformers are imported only when these are called."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from stagerd.contract import dtypes
from stagerd.engine.adopt.config_shapes import ConfigShapes
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


def model_classes(config: Mapping[str, Any]) -> list[Any]:
    """The transformers classes of the model config.json names: its `architectures`, else its model_type's
    causal LM, else its bare model."""
    import transformers as tf
    from transformers.models.auto import modeling_auto as auto

    model_type = config["model_type"]
    names: list[object] = [a for a in config.get("architectures") or () if isinstance(a, str)] or [
        auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type),
        auto.MODEL_MAPPING_NAMES.get(model_type),
    ]
    classes = (getattr(tf, n, None) if isinstance(n, str) else None for n in names)
    return [c for c in classes if isinstance(c, type) and issubclass(c, tf.PreTrainedModel)]


def meta_model(cls: Any, config: Mapping[str, Any]) -> Any:
    """`cls` built from `config` on the meta device."""
    import torch
    import transformers as tf

    with torch.device("meta"):
        return cls._from_config(tf.CONFIG_MAPPING[config["model_type"]].from_dict(dict(config)))


def saved_outputs(
    cls: Any, config: Mapping[str, Any]
) -> tuple[list[str], dict[str, tuple[int, ...]], int, Uncast]:
    """What `save_pretrained` of `cls` built from `config` writes: its names in order, their shapes, its
    num_parameters() (for the index), and per cast target the names the model keeps in float32 there."""
    from stagerd.training.trace.resolve import transformers_plan

    model = meta_model(cls, config)
    own = model.state_dict()
    plan = transformers_plan(model, own, {})
    shapes = {v.name: tuple(v.shape) for v in plan.outputs({k: tuple(v.shape) for k, v in own.items()})}
    order = [n for n in plan.order if n in shapes] or list(shapes)
    return order, shapes, model.num_parameters(), plan.uncast


@dataclass(frozen=True)
class Described:
    """config.json's model on the meta device, as the checks of names kept as they are read it: per saved
    name, the model's names it is written from (`sources`), and what `shapes` compares with."""

    model: Any
    sources: Mapping[str, list[str]]
    shapes: ConfigShapes


def describe(config: Mapping[str, Any]) -> Described | None:
    """The first class of config.json's model that builds from it here, on the meta device; None where
    none does."""
    from stagerd.training.trace.resolve import transformers_plan

    for cls in model_classes(config):
        try:
            model = meta_model(cls, config)
        except Exception:  # a config this class cannot build: the next class, if any
            continue
        own = model.state_dict()
        shapes: dict[str, set[tuple[int, ...]]] = {k: {tuple(t.shape)} for k, t in own.items()}
        sources: dict[str, list[str]] = {}  # a saved name -> the model's names it is written from
        try:
            plan = transformers_plan(model, own, {})
            zeros = {z.name: z.shape for z in plan.zeros}
            for v in plan.outputs({**{k: tuple(t.shape) for k, t in own.items()}, **zeros}):
                shapes.setdefault(v.name, set()).add(tuple(v.whole) if v.at else tuple(v.shape))
                if v.source not in zeros:
                    sources.setdefault(v.name, []).append(v.source)
        except Exception:  # a conversion not planned as byte moves: every name is searched as it is
            sources = {}
        # each rotary embedding's inverse frequencies: one per pair of the rows of a head it rotates
        rotary = {2 * b.numel() for n, b in model.named_buffers() if n.rpartition(".")[2] == "inv_freq"}
        has = {k: tuple(sorted(v)) for k, v in shapes.items()}
        return Described(model, sources, ConfigShapes(cls.__name__, has, tuple(sorted(rotary))))
    return None


def kept_fp32(described: Described, names: Sequence[str]) -> Uncast:
    """Per cast target, which of `names` (a checkpoint's, kept as they are: save_pretrained's, or the
    model's own) the `described` model keeps in float32 there, as `from_pretrained` of them does: each
    pattern searched in the model's own name, which is the name itself unless it is one its save_pretrained
    writes for another (a conversion's)."""
    from stagerd.training.trace import fp32_modules

    named = [(n, live) for n in dict.fromkeys(names) for live in described.sources.get(n, [n])]
    return fp32_modules.kept(described.model, named)
