"""What a cast export leaves in its saved dtype because transformers keeps it in float32.

`from_pretrained(dtype=...)` keeps the parameters its model class names in float32: those of
`_keep_in_fp32_modules_strict` under float16 and bfloat16, those of `_keep_in_fp32_modules` under float16
too (a MoE's router gate and its score bias, T5's `wo`), as `PreTrainedModel._get_dtype_plan` says, each
pattern searched in the model's own parameter name (`build_glob_alternation`). `save_pretrained` of such a
model writes them in float32, so an export cast to that dtype leaves them as saved. Both functions are
transformers' own, run on the live model, whose lists `post_init` collected over its submodels.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from stagerd.contract.hub_plan import HubPlan

# the cast targets transformers holds some parameters apart for: safetensors name -> torch name
TARGETS = {"BF16": "bfloat16", "F16": "float16"}


def uncast(
    model: Any, plan: HubPlan, shapes: Mapping[str, tuple[int, ...]]
) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """Per cast target, the outputs of `plan` (over the staged `shapes`, keyed by `model`'s own names)
    that read a parameter `model` keeps in float32 under that dtype."""
    zeros = {z.name for z in plan.zeros}  # a conversion's padding, never a parameter

    def named() -> Iterator[tuple[str, str]]:  # walked only for a model that lists some
        yield from ((v.name, v.source) for v in plan.outputs(shapes) if v.source not in zeros)

    return kept(model, named())


def kept(model: Any, named: Iterable[tuple[str, str]]) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """Per cast target, the output names of `named` (output name, the `model` parameter it reads; an
    output of several parts once per part) whose parameter `model` keeps in float32 under that dtype."""
    import torch

    dtype_plan = getattr(model, "_get_dtype_plan", None)
    try:
        from transformers.core_model_loading import build_glob_alternation
    except ImportError:  # a transformers without it has no such lists either
        return ()
    if dtype_plan is None:
        return ()
    named = list(named)
    out = []
    for target, torch_name in TARGETS.items():
        listed = dtype_plan(getattr(torch, torch_name))
        if not listed:
            continue
        pattern = build_glob_alternation(list(listed))[0]
        names = [name for name, own in named if pattern.search(own)]
        if names:
            out.append((target, tuple(dict.fromkeys(names))))
    return tuple(out)


def dtype_from(
    model: Any,
    plan: HubPlan,
    shapes: Mapping[str, tuple[int, ...]],
    uncast: tuple[tuple[str, tuple[str, ...]], ...],
) -> str | None:
    """The output of `model`'s first floating parameter, which `save_pretrained` names the model's dtype
    by, where some cast leaves it uncast; else None (the cast's dtype is named)."""
    parameters = getattr(model, "named_parameters", None)
    if not uncast or parameters is None:
        return None
    first = next((n for n, p in parameters() if p.is_floating_point()), None)
    out = next((v.name for v in plan.outputs(shapes) if v.source == first), None)
    return out if any(out in names for _, names in uncast) else None
