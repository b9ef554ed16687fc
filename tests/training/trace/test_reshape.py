"""A reshape that copies a permuted view (the registry's `PermuteForRope`: view, transpose, reshape) traces
as a permuted box (`reshape` + `perm`), checked against the same code run on real tensors; one that is no
permuted box is planned by its rows, and one that moves too many single elements is a HubPlanError."""

from __future__ import annotations

import pytest
import torch

from stagerd.errors import HubPlanError
from stagerd.training.trace.resolve import traced_plan


def permute_for_rope(tensor, n_heads, inverse):
    """transformers 5.24's `PermuteForRope._permute_for_rope` (older releases name it otherwise)."""
    dim0 = tensor.shape[0]
    half_head = dim0 // n_heads // 2
    head_shape = (2, half_head) if inverse else (half_head, 2)
    if tensor.ndim == 2:
        tensor = tensor.view(n_heads, *head_shape, tensor.shape[1])
        return tensor.transpose(1, 2).reshape(dim0, tensor.shape[-1])
    return tensor.view(n_heads, *head_shape).transpose(1, 2).reshape(dim0)


def carried_out(sd, plan):
    out = {}
    for v in plan.views:
        part = sd[v.source][tuple(slice(a, a + n) for a, n in zip(v.start, v.size, strict=True))]
        if v.perm:
            part = part.reshape(v.reshape).permute(v.perm)
        if v.at:
            whole = out.setdefault(v.name, torch.full(v.whole, float("nan")))
            whole[tuple(slice(a, a + n) for a, n in zip(v.at, v.shape, strict=True))] = part.reshape(v.shape)
            continue
        out[v.name] = part.reshape(v.shape)
    return out


@pytest.mark.parametrize("inverse", [False, True])
def test_permute_for_rope_is_a_permutation_of_rows(inverse):
    g = torch.Generator().manual_seed(0)
    sd = {
        "q": torch.randn(16, 6, generator=g),
        "q_bias": torch.randn(16, generator=g),
        "qkv": torch.randn(24, 6),
    }

    def convert(meta):
        out = {k: permute_for_rope(v, 2, inverse) for k, v in meta.items() if k != "qkv"}
        out["k"] = permute_for_rope(meta["qkv"][8:16], 2, inverse)  # a row block of a fused tensor
        return out

    plan = traced_plan(sd, {}, convert, "test")
    assert all(v.perm for v in plan.views)
    want = convert(sd)
    got = carried_out(sd, plan)
    assert sorted(got) == sorted(want)
    for k, w in want.items():
        assert torch.equal(got[k], w), k


def test_a_reshape_that_is_no_permuted_box_is_planned_by_its_rows():
    """Columns of a tensor read in order: each a box of one column, placed in turn."""
    sd = {"w": torch.randn(4, 6)}

    def convert(meta):
        return {"x": meta["w"][:, :3].T.reshape(-1)}

    plan = traced_plan(sd, {}, convert, "test")
    assert len(plan.views) == 3 and all(v.size == (4, 1) for v in plan.views)
    assert torch.equal(carried_out(sd, plan)["x"], convert(sd)["x"])


def test_a_reshape_that_moves_too_many_single_elements_is_refused():
    sd = {"w": torch.randn(2, 40000)}  # 40000 columns of 2 elements: 80000 single elements
    with pytest.raises(HubPlanError, match="moves single elements"):
        traced_plan(sd, {}, lambda meta: {"x": meta["w"].T.reshape(-1)}, "test")


def test_a_concatenation_of_permuted_rows_is_planned_as_its_parts():
    """The save path of `Chunk(dim=0), PermuteForRope(permute_layer_names=["q_proj", "k_proj"])`
    (gradium_phonon_tts, kimi_k25, step3p5_vision): q and k permuted back, then concatenated with v."""
    g = torch.Generator().manual_seed(1)
    sd = {n: torch.randn(8, 4, generator=g) for n in ("q_proj", "k_proj", "v_proj")}
    sd["stacked"] = torch.randn(8, 4, generator=g)

    def convert(meta):
        q, k = (permute_for_rope(meta[n], 2, True) for n in ("q_proj", "k_proj"))
        return {
            "in_proj": torch.cat([q, k, meta["v_proj"]], dim=0),
            "stack": torch.stack([permute_for_rope(meta["stacked"], 2, True), meta["stacked"]]),
        }

    plan = traced_plan(sd, {}, convert, "test")
    want, got = convert(sd), carried_out(sd, plan)
    for k, w in want.items():
        assert torch.equal(got[k], w), k
