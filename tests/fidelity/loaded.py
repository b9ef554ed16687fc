"""The reference a cast export is compared with: the model as `from_pretrained(dtype=...)` holds it."""

from __future__ import annotations

from typing import Any


def loaded_in(model: Any, dtype: Any) -> Any:
    """`model` cast to `dtype` in place as `from_pretrained(dtype=dtype)` of its float32 save holds it (its
    config's sub-configs naming `dtype` too): what its class keeps in float32 under that dtype
    (transformers' own `_get_dtype_plan`, its patterns searched in each name as its loader searches them)
    stays as it was."""
    import torch
    from transformers.core_model_loading import build_glob_alternation

    kept = model._get_dtype_plan(dtype)
    pattern = build_glob_alternation(list(kept))[0] if kept else None
    # a tied pair once, by its first name: the one save_pretrained writes and from_pretrained loads
    own = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    held = {n: t.detach().clone() for n, t in own.items() if pattern is not None and pattern.search(n)}
    model.to(dtype)
    for key in model.config.sub_configs:  # as from_pretrained(dtype=...) names them (its `_get_dtype`)
        if (sub := getattr(model.config, key, None)) is not None:
            sub.dtype = dtype
    with torch.no_grad():
        for n, t in {**dict(model.named_parameters()), **dict(model.named_buffers())}.items():
            if n in held:
                t.data = held[n]
    return model
