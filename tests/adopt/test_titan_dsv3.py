"""A torchtitan DeepSeek V3 run (torchtitan's own model package and CheckpointManager: titan_dsv3_ranks.py;
MLA with a low-rank query, a dense layer, then MoE with shared experts and a routing bias): `watch --adopt`
with its config.json plans the names with torchtitan's own `DeepSeekV3StateDictAdapter.to_hf` and
publishes the last step as exactly what to_hf gives, byte for byte what `save_pretrained` writes of it, and
`from_pretrained` of the export computes what torchtitan's model computes (MLA's layout, RoPE's
interleaved rows as transformers reads them). The planning alone, for a query with and without low rank,
and what it refuses, on meta stand-ins."""

from __future__ import annotations

import pytest

from tests.adopt import titan_dsv3_ranks
from tests.adopt.helpers import published, watch_once
from tests.fidelity import harness
from tests.gloo import launch

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("titan-dsv3")
    base, ref = tmp / "run", tmp / "ref"
    ref.mkdir()
    launch(titan_dsv3_ranks.save_and_reference, str(base), str(ref), True, world=1, deadline_s=240)
    res = watch_once(base / "checkpoint", tmp / "out", "--extras", str(base))
    assert res.returncode == 0, res.stdout + res.stderr
    return tmp


def test_the_export_is_to_hf_and_save_pretrained(run):
    last = published(run / "out", titan_dsv3_ranks.STEPS)
    harness.assert_same_tensors(last, run / "ref" / "to_hf")
    harness.assert_same_tensors(last, run / "ref" / "last")
    harness.assert_same_weight_files(last, run / "ref" / "last")
    assert published(run / "out", 1).is_dir()


def test_from_pretrained_computes_what_torchtitan_trained(run):
    import torch
    import transformers as tf

    last = published(run / "out", titan_dsv3_ranks.STEPS)
    model, info = tf.AutoModelForCausalLM.from_pretrained(last, output_loading_info=True)
    assert type(model).__name__ == "DeepseekV3ForCausalLM"
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    with torch.no_grad():
        out = model.eval()(input_ids=titan_dsv3_ranks.tokens(), output_hidden_states=True)
    want = torch.load(run / "ref" / "titan.pt")
    # Layer 0 (embedding, MLA with its RoPE, dense MLP): the same float32 math in another implementation.
    # RoPE rows read in the wrong order are off by about 1e-2 here, a swapped MLA split by 0.3.
    layer0 = out.hidden_states[1]
    assert torch.allclose(layer0, want["layer0"], atol=1e-4, rtol=0), (layer0 - want["layer0"]).abs().max()
    # torchtitan's routed experts multiply in bfloat16 (its GroupedExperts casts), transformers' in float32:
    # about 3e-3 apart at most here.
    logits = out.logits
    assert torch.allclose(logits, want["logits"], atol=1e-2, rtol=0), (logits - want["logits"]).abs().max()


def _meta_tensors(q_lora: bool, mtp: bool = False) -> dict[str, tuple[tuple[int, ...], str]]:
    import torch

    config = titan_dsv3_ranks.titan_config(q_lora)
    if mtp:
        from torchtitan.models.deepseek_v3 import _build_mtp_layers

        config.mtp_layers = _build_mtp_layers(config.layers[-1], dim=titan_dsv3_ranks.DIM, num_mtp_layers=1)
    with torch.device("meta"):
        model = config.build()
    return {k: (tuple(v.shape), "F32") for k, v in model.state_dict().items()}


@pytest.mark.parametrize("q_lora", [True, False], ids=["q-lora", "q-proj"])
def test_the_plan_is_save_pretrained_names_with_a_low_rank_query_or_not(q_lora):
    from stagerd.daemon.titan_names import titan_plan
    from stagerd.errors import HubPlanError

    tensors = _meta_tensors(q_lora)
    config = titan_dsv3_ranks.hf_config(q_lora).to_dict()
    plan = titan_plan(tensors, config)
    assert plan is not None
    query = "q_a_proj" if q_lora else "q_proj"
    assert f"model.layers.0.self_attn.{query}.weight" in plan.order
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in plan.order
    # a bf16 or fp16 export leaves the router as saved, as transformers keeps it in float32
    router = {"model.layers.1.mlp.gate.weight", "model.layers.1.mlp.gate.e_score_correction_bias"}
    assert set(plan.uncast_for("BF16")) == set(plan.uncast_for("F16")) == router
    # a config.json whose query is the other kind is not this checkpoint's model
    with pytest.raises(HubPlanError, match="KeyError"):
        titan_plan(tensors, {**config, "q_lora_rank": None if q_lora else 8})
    with pytest.raises(HubPlanError, match=r"lacking \['model.layers.0.mlp.experts.0.down_proj.weight'"):
        titan_plan(tensors, {**config, "first_k_dense_replace": 0})


def test_what_transformers_would_not_compute_with_is_refused_by_name():
    from stagerd.daemon.titan_names import titan_plan
    from stagerd.errors import HubPlanError

    tensors = _meta_tensors(True)
    config = titan_dsv3_ranks.hf_config(True).to_dict()
    with pytest.raises(HubPlanError, match="rope_interleave false"):
        titan_plan(tensors, {**config, "rope_interleave": False})
    with pytest.raises(HubPlanError, match=r"mtp_layers"):
        titan_plan(_meta_tensors(True, mtp=True), config)
    # torchtitan's DeepSeek V3 to_hf keeps a tied head, which save_pretrained does not write
    with pytest.raises(HubPlanError, match=r"extra \['lm_head.weight'\]"):
        titan_plan(tensors, {**config, "tie_word_embeddings": True})
