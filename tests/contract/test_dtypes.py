"""The dtype table against safetensors' own writer."""

from __future__ import annotations

import json

import torch
from safetensors.torch import save

from stagerd.contract import dtypes


def test_writer_rank_is_the_order_safetensors_writes():
    """safetensors lays out a file by its `Dtype` enum, descending: one tensor of every dtype torch has,
    named so that name order would say the opposite, comes out in `writer_rank` order."""
    have = [d for d in dtypes.DTYPES.values() if d.torch_name is not None]
    ranked = sorted(have, key=lambda d: dtypes.writer_rank(d.name))
    tensors = {f"t{i:02d}": torch.zeros(2, dtype=getattr(torch, d.torch_name)) for i, d in enumerate(ranked)}
    raw = save(tensors)
    header = json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")])
    header.pop("__metadata__", None)
    assert [e["dtype"] for e in header.values()] == [d.name for d in reversed(ranked)]
    assert sorted(dtypes.writer_rank(n) for n in dtypes.DTYPES) == list(
        range(len(dtypes.DTYPES))
    )  # F4, F6 too
