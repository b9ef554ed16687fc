"""Trainable tokens (`trainable_token_indices`) in the merged export of a LoRA model.

PEFT keeps an embedding's trained rows apart (`token_adapter.trainable_tokens_delta.<adapter>`, one row per
index) beside its base weight (`token_adapter.base_layer.weight`); `merge_and_unload()` copies them over
the base weight's rows (`index_copy`, cast to its dtype) and puts the base layer back in the wrapper's
place. That is a byte move: the merged weight is the base weight's runs of rows between the indices and
the adapter's rows at them, the parts of one output in the plan. Rows of another dtype than the base
weight's (float32 rows of a bf16 model, under PEFT's default `autocast_adapter_dtype`) are cast as the
merge casts them (`.to(weight)`), a `CAST` merge the engine computes, whose output the parts then read.
The indices must be distinct (else which row wins is not defined).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from stagerd.contract import dtypes
from stagerd.contract.hub_plan import TensorView
from stagerd.contract.lora_merge import LoraMerge, MergeKind
from stagerd.errors import HubPlanError

_PREFIX = "base_model.model."
ADAPTER = "token_adapter"
DELTA = "trainable_tokens_delta"


@dataclass(frozen=True)
class TokenRows:
    """The trained rows of adapter `delta`'s `indices`, merged into staged weight `base`."""

    path: str  # the wrapper's path in the merged model ("model.embed_tokens")
    base: str
    delta: str  # the staged rows, or their cast's output
    indices: tuple[int, ...]
    cast: LoraMerge | None = None  # the rows cast to the base weight's dtype, read from the staged ones

    @property
    def consumed(self) -> str:
        """The staged key of the trained rows."""
        return self.cast.base if self.cast is not None else self.delta


def unwrapped_paths(model: Any) -> dict[str, str]:
    """Each `TrainableTokensWrapper`'s path in the merged model -> its weight's module in the PEFT model's
    (without PEFT's prefix), which merge_and_unload() puts in the wrapper's place (tied ones too)."""
    from peft.utils.other import TrainableTokensWrapper

    paths = [
        n.removeprefix(_PREFIX) for n, m in model.named_modules() if isinstance(m, TrainableTokensWrapper)
    ]
    return {p: f"{p}.{ADAPTER}" for p in paths}


def token_rows(
    model: Any, name: str, sd: Mapping[str, torch.Tensor], staged: Mapping[str, str]
) -> list[TokenRows]:
    """Each `TrainableTokensWrapper` whose own rows of adapter `name` merge_and_unload() copies in (a tied
    one, an output layer sharing the embeddings', follows the one it is tied to: its keys are aliases)."""
    from peft.utils.other import TrainableTokensWrapper

    out = []
    wrappers = [
        (n, getattr(m, ADAPTER)) for n, m in model.named_modules() if isinstance(m, TrainableTokensWrapper)
    ]
    followers = {
        f"{n}.{ADAPTER}.base_layer.weight" for n, layer in wrappers if layer.tied_adapter is not None
    }
    for mname, layer in wrappers:
        base, delta = f"{mname}.{ADAPTER}.base_layer.weight", f"{mname}.{ADAPTER}.{DELTA}.{name}"
        if layer.tied_adapter is not None or name not in layer.token_indices:
            continue
        if base not in staged or delta not in staged:
            raise HubPlanError(f"{mname!r}: its base weight or trainable tokens are not in the state dict")
        # Rows copied into a weight another layer shares (tied, not following these rows: other indices,
        # or no rows of its own) change that layer too, which the trained model does not.
        if any(k != base and k not in followers for k, v in staged.items() if v == staged[base]):
            raise HubPlanError(
                f"{mname!r}: trainable tokens of a tied weight whose tied layer does not share them (other"
                " indices, or none): merge_and_unload() copies them into the one shared weight"
            )
        base, delta = staged[base], staged[delta]
        indices = tuple(int(i) for i in layer.token_indices[name])
        rows, weight = sd[delta], sd[base]
        if weight.dim() != 2 or tuple(rows.shape) != (len(indices), weight.shape[1]):
            raise HubPlanError(
                f"{mname!r}: {list(rows.shape)} trainable tokens of a {list(weight.shape)} weight"
            )
        if len(set(indices)) != len(indices) or not all(0 <= i < weight.shape[0] for i in indices):
            raise HubPlanError(f"{mname!r}: its token indices repeat or are out of range: {list(indices)}")
        cast = None
        if rows.dtype != weight.dtype:  # merge(): `trainable_tokens_delta[name].to(weight)`
            dt = dtypes.safetensors_name(weight.dtype)
            cast = LoraMerge(f"{delta}:{dt}", delta, "", "", 1.0, kind=MergeKind.CAST, dtype=dt)
        out.append(TokenRows(mname.removeprefix(_PREFIX), base, cast.name if cast else delta, indices, cast))
    return out


def row_parts(v: TensorView, rows: TokenRows, shape: tuple[int, ...]) -> list[TensorView]:
    """Output `v` of the merged weight (read whole) as its parts: runs of base rows and of trained rows."""
    if not v.is_whole(shape):
        raise HubPlanError(f"{v.name!r}: save_pretrained converts a weight with trainable tokens")
    at_row = {i: j for j, i in enumerate(rows.indices)}
    rest, zero = tuple(shape[1:]), (0,) * (len(shape) - 1)
    parts, r = [], 0
    while r < shape[0]:
        j = at_row.get(r)
        n = 1
        if j is None:
            while r + n < shape[0] and r + n not in at_row:
                n += 1
            source, start = rows.base, r
        else:
            while at_row.get(r + n) == j + n:
                n += 1
            source, start = rows.delta, j
        box = (n, *rest)
        parts.append(TensorView(v.name, source, (start, *zero), box, box, at=(r, *zero), whole=tuple(shape)))
        r += n
    return parts
