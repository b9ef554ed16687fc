"""A to-Hub plan's LoRA merges carried out by the engine (engine/merge.py): W + scaling * (B @ A), with
numpy in row blocks, from blocks sharded along either dim or a 2-D mesh, `fan_in_fan_out`, bf16, cast on
export; compared with PEFT's own arithmetic in torch: bit for bit, but DoRA, whose norm is summed in
another order than torch's (a few float32 ulps)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from stagerd.contract.hub_plan import HubPlan, TensorView
from stagerd.contract.lora_merge import ExpertLayout, LoraMerge, MergeKind
from stagerd.engine import merge
from stagerd.engine.consolidate import consolidate_into
from stagerd.engine.planner import plan
from stagerd.engine.shard_scan import scan_shards
from stagerd.errors import HubPlanError
from tests.dcp_fixtures import Spec, dcp_save

pytestmark = pytest.mark.slow
EOI, EIO = ExpertLayout.EOI, ExpertLayout.EIO


def lora() -> Spec:
    g = torch.Generator().manual_seed(7)
    return {
        "q.base": (torch.randn(24, 16, generator=g), "S0"),  # FSDP2: rows by rank
        "q.A": (torch.randn(4, 16, generator=g), "S0"),
        "q.B": (torch.randn(24, 4, generator=g), "S0"),
        "c.base": (torch.randn(16, 24, generator=g), "B01"),  # Conv1D, in x out, on a 2-D mesh
        "c.A": (torch.randn(2, 16, generator=g), "R"),
        "c.B": (torch.randn(24, 2, generator=g), "S1"),
        "h.base": (torch.randn(16, 16, generator=g).bfloat16(), "S1"),
        "h.A": (torch.randn(2, 16, generator=g).bfloat16(), "S0"),
        "h.B": (torch.randn(16, 2, generator=g).bfloat16(), "S0"),
        "norm": (torch.randn(16, generator=g), "R"),
        "d.base": (torch.randn(24, 16, generator=g), "S0"),  # DoRA: its magnitude split by rank too
        "d.A": (torch.randn(2, 16, generator=g), "S0"),
        "d.B": (torch.randn(24, 2, generator=g), "S0"),
        "d.m": (torch.rand(24, generator=g) + 0.5, "S0"),
        "e.base": (torch.randn(16, 24, generator=g).bfloat16(), "B01"),  # DoRA, fan_in_fan_out, bf16 W
        "e.A": (torch.randn(2, 16, generator=g), "R"),
        "e.B": (torch.randn(24, 2, generator=g), "S1"),
        "e.m": (torch.rand(24, generator=g) + 0.5, "S0"),
        "q.bias": (torch.randn(24, generator=g), "S0"),  # a LoRA bias
        "q.B.bias": (torch.randn(24, generator=g), "S0"),
        # fused experts [e, out, in], rows by rank; rank x out x in >= 400: torch's bmm sums it in BLAS
        "x.base": (torch.randn(4, 16, 20, generator=g), "S1"),
        "x.A": (torch.randn(4 * 4, 20, generator=g), "S0"),
        "x.B": (torch.randn(16, 4 * 4, generator=g), "S1"),
        # [e, in, out], experts by rank (6 over 4); under 400: torch's own loop, unfused
        "y.base": (torch.randn(6, 8, 5, generator=g), "S0"),
        "y.A": (torch.randn(6 * 3, 8, generator=g), "S0"),
        "y.B": (torch.randn(5, 3 * 6, generator=g), "R"),
        "z.base": (torch.randn(16, 16, generator=g).bfloat16(), "S0"),  # one matrix: a router's weight
        "z.A": (torch.randn(2, 16, generator=g), "R"),
        "z.B": (torch.randn(16, 2, generator=g), "S0"),
        # float32 adapters on bf16 bases: a Linear rounds once, an Embedding (in x out) twice
        "l.base": (torch.randn(24, 16, generator=g).bfloat16(), "S1"),
        "l.A": (torch.randn(4, 16, generator=g), "R"),
        "l.B": (torch.randn(24, 4, generator=g), "S0"),
        "v.base": (torch.randn(16, 24, generator=g).bfloat16(), "S0"),
        "v.A": (torch.randn(2, 16, generator=g), "S1"),
        "v.B": (torch.randn(24, 2, generator=g), "R"),
    }


def hub() -> HubPlan:
    merges = (
        LoraMerge("q", "q.base", "q.A", "q.B", 2.0),
        LoraMerge("c", "c.base", "c.A", "c.B", 0.5 / 2**0.5, fan_in_fan_out=True),  # rslora-like
        LoraMerge("h", "h.base", "h.A", "h.B", 4.0),
        LoraMerge("l", "l.base", "l.A", "l.B", 0.75),
        LoraMerge("v", "v.base", "v.A", "v.B", 2.0, fan_in_fan_out=True, delta_to_base=True),
        LoraMerge("d", "d.base", "d.A", "d.B", 0.5, kind=MergeKind.DORA, magnitude="d.m"),
        LoraMerge("e", "e.base", "e.A", "e.B", 2.0, True, MergeKind.DORA, "e.m"),
        LoraMerge("q_bias", "q.bias", "", "q.B.bias", 2.0, kind=MergeKind.BIAS),
        LoraMerge("x", "x.base", "x.A", "x.B", 2.0, kind=MergeKind.EXPERTS, experts=4, layout=EOI),
        LoraMerge("y", "y.base", "y.A", "y.B", 0.5, kind=MergeKind.EXPERTS, experts=6, layout=EIO),
        LoraMerge("z", "z.base", "z.A", "z.B", 4.0, kind=MergeKind.EXPERTS, experts=1, layout=EOI),
    )
    # a merged tensor read by a view like any staged one: renamed
    return HubPlan((TensorView("q_proj", "q", (0, 0), (24, 16), (24, 16)),), (), "peft", merges=merges)


def peft_merge(w, a, b, s, fifo=False, embedding=False):
    """PEFT's Linear.merge: delta in float32 for half types on CPU, rounded to B's dtype, added in place
    (rounded once to W's dtype); Embedding.merge casts the delta to W's dtype first."""
    wide = a.float() if a.dtype in (torch.float16, torch.bfloat16) else a
    delta = (b.to(wide.dtype) @ wide) * s
    delta = (delta.T if fifo else delta).to(b.dtype)
    out = w.clone()
    out += delta.to(w.dtype) if embedding else delta
    return out


def peft_dora(w, a, b, m, s, fifo=False):
    """PEFT's DoraLinearVariant.merge_unsafe: the norm per output of W + delta, in their promoted dtype."""
    wide = a.float() if a.dtype in (torch.float16, torch.bfloat16) else a
    delta = (b.to(wide.dtype) @ wide) * s
    delta = (delta.T if fifo else delta).to(b.dtype)
    summed = (w.T + delta.T) if fifo else (w + delta)
    norm = torch.linalg.norm(summed, dim=1).to(summed.dtype)
    factor = (m / norm).view(-1, 1)
    return ((factor.T if fifo else factor) * (w + delta)).to(w.dtype)


def peft_experts(w, a, b, s, layout):
    """PEFT's ParamWrapper.merge: one matrix as a Linear's delta, experts as its einsum (in the adapter's
    dtype, times scaling rounded there too); the delta cast to W's dtype before it is added."""
    n = w.shape[0] if w.dim() == 3 else 1
    if n == 1:
        wide = a.float() if a.dtype in (torch.float16, torch.bfloat16) else a
        delta = ((b.to(wide.dtype) @ wide) * s).to(b.dtype)
    else:
        a3, b3 = a.reshape(n, -1, a.shape[-1]), b.reshape(b.shape[0], -1, n)
        delta = torch.einsum(f"o r e, e r i -> {' '.join(layout)}", b3, a3) * s
    return w + delta.to(w.dtype)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    src = tmp_path_factory.mktemp("merge") / "shards"
    return src, dcp_save(src, world=4, builder=lora)


@pytest.mark.parametrize("dtype", [None, "BF16"])
@pytest.mark.parametrize("block", [None, 80])  # 80 bytes: one or two rows per block
def test_merges_are_peft_arithmetic(tmp_path, saved, monkeypatch, dtype, block):
    src, full = saved
    if block is not None:
        monkeypatch.setattr(merge, "BLOCK_BYTES", block)
    out = tmp_path / "out"
    out.mkdir()
    res = consolidate_into(src, out, views=hub(), dtype=dtype)
    got: dict[str, torch.Tensor] = {}
    for name, _ in res.files:
        got.update(load_file(out / name))
    assert sorted(got) == [
        "c",
        "d",
        "e",
        "h",
        "l",
        "norm",
        "q_bias",
        "q_proj",
        "v",
        "x",
        "y",
        "z",
    ]  # inputs consumed, not written
    want = {
        "q_proj": peft_merge(full["q.base"], full["q.A"], full["q.B"], 2.0),
        "c": peft_merge(full["c.base"], full["c.A"], full["c.B"], 0.5 / 2**0.5, fifo=True),
        "h": peft_merge(full["h.base"], full["h.A"], full["h.B"], 4.0),
        "d": peft_dora(full["d.base"], full["d.A"], full["d.B"], full["d.m"], 0.5),
        "e": peft_dora(full["e.base"], full["e.A"], full["e.B"], full["e.m"], 2.0, fifo=True),
        "q_bias": full["q.bias"] + full["q.B.bias"] * 2.0,
        "x": peft_experts(full["x.base"], full["x.A"], full["x.B"], 2.0, "eoi"),
        "y": peft_experts(full["y.base"], full["y.A"], full["y.B"], 0.5, "eio"),
        "z": peft_experts(full["z.base"], full["z.A"], full["z.B"], 4.0, "eoi"),
        "l": peft_merge(full["l.base"], full["l.A"], full["l.B"], 0.75),
        "v": peft_merge(full["v.base"], full["v.A"], full["v.B"], 2.0, fifo=True, embedding=True),
    }
    # products and DoRA's norms summed as torch sums them (engine/torch_sum.py, torch_norm.py): bit for bit
    for name, w in want.items():
        w = w if dtype is None else w.to(torch.bfloat16)
        assert got[name].dtype == w.dtype and got[name].shape == w.shape, name
        assert torch.equal(got[name], w), name
    assert torch.equal(got["norm"], full["norm"] if dtype is None else full["norm"].bfloat16())
    assert not any(p.name.startswith(".stagerd-merge-") for p in tmp_path.iterdir())  # scratch removed


def test_a_merge_the_checkpoint_contradicts_is_a_named_error(saved, tmp_path):
    src, _ = saved
    bad = {
        "not saved": LoraMerge("x", "nope", "q.A", "q.B", 1.0),
        "do not fit": LoraMerge("x", "q.base", "c.A", "q.B", 1.0),
        "matrices": LoraMerge("x", "norm", "q.A", "q.B", 1.0),
        "would replace": LoraMerge("norm", "q.base", "q.A", "q.B", 1.0),
        "not finite": LoraMerge("x", "q.base", "q.A", "q.B", float("inf")),
        "not one value per output": LoraMerge(
            "x", "d.base", "d.A", "d.B", 1.0, False, MergeKind.DORA, "norm"
        ),
        "not a dora merge": LoraMerge("x", "d.base", "d.A", "d.B", 1.0, kind=MergeKind.DORA),
        "does not fit base bias": LoraMerge("x", "q.bias", "", "norm", 1.0, kind=MergeKind.BIAS),
        "is not 3 experts' eoi": LoraMerge(
            "w", "x.base", "x.A", "x.B", 1.0, kind=MergeKind.EXPERTS, experts=3, layout=EOI
        ),
        "do not fit 4 experts": LoraMerge(
            "w", "x.base", "x.A", "x.B", 1.0, kind=MergeKind.EXPERTS, experts=4, layout=EIO
        ),
        "is not 1 experts' eio": LoraMerge(
            "w", "z.base", "z.A", "z.B", 1.0, kind=MergeKind.EXPERTS, experts=1, layout=EIO
        ),
        "not a dora merge's": LoraMerge(
            "w", "d.base", "d.A", "d.B", 1.0, kind=MergeKind.DORA, magnitude="d.m", delta_to_base=True
        ),
        "not a experts merge": LoraMerge(
            "w", "x.base", "x.A", "x.B", 1.0, kind=MergeKind.EXPERTS, layout=EOI
        ),
    }
    for words, m in bad.items():
        (tmp_path / words).mkdir()
        with pytest.raises(HubPlanError, match=words):
            consolidate_into(src, tmp_path / words, views=HubPlan(merges=(m,)))
    with pytest.raises(HubPlanError, match="was not computed"):  # planned without the engine's merge
        plan(scan_shards(src), views=hub())


def test_merges_round_trip_through_the_marker_json():
    h = hub()
    d = json.loads(json.dumps(h.to_json()))
    assert HubPlan.from_json(d) == h
    assert "merges" not in HubPlan().to_json()  # plans without merges are written as before
    assert [m["kind"] for m in d["variant_merges"]] == ["dora", "dora", "bias"]  # apart from plain LoRA
    assert "a" not in d["variant_merges"][2]
    assert d["merges"][-1]["delta_to_base"] is True and "delta_to_base" not in d["merges"][0]
    assert [(m["experts"], m["layout"]) for m in d["expert_merges"]] == [(4, "eoi"), (6, "eio"), (1, "eoi")]
    d["variant_merges"][0]["kind"] = "lora"
    with pytest.raises(HubPlanError, match="malformed"):
        HubPlan.from_json(d)
    d = json.loads(json.dumps(h.to_json()))
    d["merges"][0]["scaling"] = "2"
    with pytest.raises(HubPlanError, match="malformed"):
        HubPlan.from_json(d)
