"""Zeros a conversion makes, rows picked by a list, reshapes of concatenations and single-element RoPE
permutations: each traces into a plan whose parts, carried out on real tensors, give what the op gives.
`pad_vocab` and `split_queries` are the save-time code of transformers 5.24's `Inkling2UnpadVocab` (zero
rows appended) and `Inkling2LoopMergeMessageQueries` (rows picked by a list, then flattened), so these
run on any transformers; the registry tests run the ops themselves on whole models."""

from __future__ import annotations

import pytest
import torch

from stagerd.contract.hub_plan import HubPlan
from stagerd.errors import HubPlanError
from stagerd.training.trace.resolve import traced_plan
from tests.training.trace.test_reshape import carried_out, permute_for_rope


def pad_vocab(tensor, vocab_size):
    padding = tensor.new_zeros(vocab_size - tensor.shape[0], *tensor.shape[1:])
    return torch.cat([tensor, padding], dim=0)


def split_queries(tensor):
    return tensor[:, [0, 3]].flatten(0, 1).contiguous(), tensor[:, 1:3].flatten(0, 1).contiguous()


def run(sd, plan):
    """`carried_out` with each zero fill a tensor of zeros, as the export's scratch shard reads."""
    dtypes = {"F32": torch.float32, "BF16": torch.bfloat16}
    zeros = {z.name: torch.zeros(z.shape, dtype=dtypes[z.dtype]) for z in plan.zeros}
    return carried_out({**sd, **zeros}, plan)


def check(sd, convert, plan):
    want, got = convert(sd), run(sd, plan)
    read = {v.source for v in plan.views}
    got |= {k: t for k, t in sd.items() if k not in read and k not in plan.drop}  # written as staged
    assert sorted(got) == sorted(want)
    for k, w in want.items():
        assert got[k].dtype == w.dtype and torch.equal(got[k], w), k


@pytest.mark.parametrize("unpadded", [6, 8])
def test_padding_with_zero_rows_is_a_zero_fill_part(unpadded):
    sd = {"lm_head": torch.randn(unpadded, 4)}

    def convert(meta):
        return {"unembed": pad_vocab(meta["lm_head"], 8)}

    plan = traced_plan(sd, {}, convert, "test")
    check(sd, convert, plan)
    if unpadded == 8:  # nothing to pad: a rename, no zero fill
        assert not plan.zeros and [(v.name, v.at) for v in plan.views] == [("unembed", ())]
    else:
        (z,) = plan.zeros
        assert (z.dtype, z.shape) == ("F32", (2, 4))
        assert {v.source: v.at for v in plan.views} == {"lm_head": (0, 0), z.name: (6, 0)}


def test_rows_picked_by_a_list_and_flattened_are_planned_row_by_row():
    sd = {"query": torch.randn(3, 4, 5)}

    def convert(meta):
        return dict(zip(["queries", "kv_queries"], split_queries(meta["query"]), strict=True))

    plan = traced_plan(sd, {}, convert, "test")
    check(sd, convert, plan)
    assert all(v.source == "query" and v.size == (1, 1, 5) for v in plan.views)


def test_zeros_keep_through_views_and_casts():
    sd = {"w": torch.randn(4, 6)}

    def convert(meta):
        z = meta["w"].new_zeros(3, 6).to(torch.bfloat16)[1:]
        full = torch.full_like(meta["w"], 0.0)
        return {"z": z.T.contiguous(), "like": torch.zeros_like(meta["w"]), "w": meta["w"], "full": full}

    plan = traced_plan(sd, {}, convert, "test")
    check(sd, convert, plan)
    assert sorted((z.dtype, z.shape) for z in plan.zeros) == [
        ("BF16", (6, 2)),
        ("F32", (4, 6)),
        ("F32", (4, 6)),
    ]


@pytest.mark.parametrize(
    ("op", "words"),
    [
        (lambda w: w.new_zeros(1, 6) + 1, "add of zeros"),
        (lambda w: w.new_ones(1, 6), "new_ones"),
        (lambda w: w.new_full((1, 6), 2.0), "new_full"),
        (lambda w: w[:1].to(torch.bfloat16), "'to'"),
        (lambda w: w[torch.tensor([0, 2])], "__getitem__"),
    ],
)
def test_what_is_no_byte_move_is_refused_with_the_op(op, words):
    sd = {"w": torch.randn(4, 6)}
    with pytest.raises(HubPlanError, match=words):
        traced_plan(sd, {}, lambda meta: {"x": torch.cat([meta["w"], op(meta["w"])])}, "test")


def test_a_reshape_of_a_concatenation_is_planned_as_runs_of_its_rows():
    sd = {"a": torch.randn(4, 3), "b": torch.randn(4, 3)}

    def convert(meta):
        return {"x": torch.stack([meta["a"], meta["b"]], dim=1).reshape(8, 3)}  # rows interleaved

    plan = traced_plan(sd, {}, convert, "test")
    check(sd, convert, plan)


def test_a_rope_permutation_of_a_bias_moves_single_elements():
    """PermuteForRope on a 1-dim bias (kimi_k25's vision q/k biases): its last dim moves, so the
    export moves it element by element; allowed up to MAX_ELEMENT_MOVES elements."""
    from stagerd.contract.hub_plan import MAX_ELEMENT_MOVES, moves_elements

    sd = {"bias": torch.randn(16)}

    def convert(meta):
        return {"b": permute_for_rope(meta["bias"], 2, True)}

    plan = traced_plan(sd, {}, convert, "test")
    (v,) = plan.views
    assert moves_elements(v)
    check(sd, convert, plan)
    big = {"bias": torch.empty(2 * MAX_ELEMENT_MOVES, device="meta")}
    with pytest.raises(HubPlanError, match="moves single elements"):
        traced_plan(big, {}, convert, "test")


def test_a_plan_with_zero_fills_round_trips_and_one_without_is_unchanged():
    sd = {"lm_head": torch.randn(6, 4)}
    plan = traced_plan(sd, {}, lambda m: {"u": pad_vocab(m["lm_head"], 8)}, "t")
    assert HubPlan.from_json(plan.to_json()) == plan
    old = {"format": "stagerd.hub/1", "origin": "t", "views": [], "drop": ["x"]}  # a marker before zeros
    assert HubPlan.from_json(old).to_json() == old
    shapes = {"lm_head": (6, 4)}
    with pytest.raises(HubPlanError, match=r"zero fill .* was not made"):
        plan.outputs(shapes)  # the engine adds the zero fills' shapes from its scratch shard
    assert len(plan.outputs({**shapes, plan.zeros[0].name: (2, 4)})) == 2


def test_a_reshape_of_a_concatenation_into_too_many_runs_is_refused():
    sd = {"a": torch.randn(3, 40000), "b": torch.randn(3, 40000)}  # transposed: columns of 3 elements
    with pytest.raises(HubPlanError, match="reshape of a concatenation"):
        traced_plan(sd, {}, lambda m: {"x": torch.cat([m["a"].T, m["b"].T], dim=1).reshape(-1)}, "test")


def interleave(tensor, dim, inverse):
    """transformers 5.24's `Interleave.convert` (Inkling's multimodal shared experts: `Interleave(dim=1)`
    then `Chunk(dim=1)`, reversed on save as a concatenation, then this with `inverse=True`)."""
    shape = list(tensor.shape)
    shape[dim : dim + 1] = [2, shape[dim] // 2] if inverse else [shape[dim] // 2, 2]
    return tensor.reshape(shape).transpose(dim, dim + 1).reshape(tensor.shape).contiguous()


def test_a_transpose_of_a_concatenation_permutes_each_part():
    sd = {"gate": torch.randn(4, 6), "up": torch.randn(4, 6), "w": torch.randn(3, 5)}

    def convert(meta):
        joined = torch.cat([meta["gate"], meta["up"]], dim=1)
        padded = torch.cat([meta["w"], meta["w"].new_zeros(1, 5)]).permute(1, 0)
        return {"w13": interleave(joined, 1, True), "t": joined.t().contiguous(), "p": padded.contiguous()}

    plan = traced_plan(sd, {}, convert, "test")
    check(sd, convert, plan)
    assert {v.source for v in plan.views} >= {"gate", "up", "w"} and len(plan.zeros) == 1


def test_an_interleave_of_a_concatenation_past_the_run_limit_is_refused_by_name():
    sd = {"gate": torch.empty(64, 1024, device="meta"), "up": torch.empty(64, 1024, device="meta")}
    with pytest.raises(HubPlanError, match="reshape of a concatenation"):
        traced_plan(
            sd, {}, lambda m: {"w13": interleave(torch.cat([m["gate"], m["up"]], 1), 1, True)}, "test"
        )
