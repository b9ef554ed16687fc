"""Keys of a model state dict that alias another key's tensor (tied weights) are staged once.

safetensors refuses tensors that share memory, so DCP's HF writer cannot write `lm_head.weight` beside the
`model.embed_tokens.weight` it is tied to. The first key (in state dict order) is staged; every later key
whose tensor is the same is recorded as an alias of it, and the to-Hub plan decides what the export
writes for it: its own copy of the bytes, or nothing where save_pretrained leaves the tied duplicate out.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor


def _identity(t: torch.Tensor) -> tuple[Any, ...] | None:
    """The same bytes: the (local) tensor's storage, offset, shape, stride and dtype, and the global shape.
    None for a tensor without storage (nothing to alias). FSDP2's local shards, even empty ones, are views
    of each parameter's own padded storage, so every rank finds the same aliases."""
    local = t._local_tensor if isinstance(t, DTensor) else t
    storage = local.untyped_storage()
    if storage.data_ptr() == 0:
        return None
    return (storage.data_ptr(), local.storage_offset(), tuple(local.shape), tuple(local.stride()),
            local.dtype, tuple(t.shape))  # fmt: skip


def split_aliases(sd: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """The state dict without aliased duplicates, and {duplicate key: the key staged for it}."""
    first: dict[tuple[Any, ...], str] = {}
    kept: dict[str, Any] = {}
    aliases: dict[str, str] = {}
    for k, v in sd.items():
        ident = _identity(v) if isinstance(v, torch.Tensor) else None
        if ident is not None:
            if ident in first:
                aliases[k] = first[ident]
                continue
            first[ident] = k
        kept[k] = v
    return kept, aliases


def _bits(t: torch.Tensor) -> torch.Tensor:
    local = t._local_tensor if isinstance(t, DTensor) else t
    return local.detach().reshape(-1).view(torch.uint8)


def untied_copies(sd: dict[str, Any], aliases: dict[str, str], saved: Any) -> dict[str, Any]:
    """For each alias whose step holds both keys (it was saved untied), an empty tensor like it to load
    the alias's own saved values into: a tied model can hold them only if they equal its first key's."""
    if not saved:
        return {}
    return {a: torch.empty_like(sd[a]) for a, k in aliases.items() if a in saved and k in saved}


def differing(
    loaded: dict[str, Any], aliases: dict[str, str], copies: dict[str, Any]
) -> list[tuple[str, str]]:
    """(first key, alias) of every pair whose saved values differ (bit for bit) in this rank's part."""
    return [
        (aliases[a], a) for a, c in copies.items() if not torch.equal(_bits(loaded[aliases[a]]), _bits(c))
    ]
