"""`stagerd watch --adopt` on what NeMo AutoModel 0.7 writes when it trains LoRA on a MoE's experts (a tiny
Qwen3-MoE, its own grouped experts, driven in-process on gloo CPU ranks, see automodel_moe_peft_run.py).

Through its state-dict adapter (the model's default) AutoModel saves the experts' factors in PEFT's fused
layout (`experts.lora_A.weight` [rank * experts, in], `target_parameters`): published as written,
`PeftModel.from_pretrained` on transformers' Qwen3-MoE loads every trained factor, none missing or left
over, and reads them back as AutoModel trained them. Without it (the layout AutoModel keeps for the
models it did not validate) the factors keep AutoModel's own names and shapes, which PEFT drops without a
word: the adoption refuses them by name, publishes nothing and leaves the trainer's files as they were.
So it does where AutoModel's `moe_rank_scaling` gave the experts a rank adapter_config.json does not state
(PEFT would fail on their sizes)."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest

from tests.adopt.helpers import published, tree_digest, watch_once
from tests.adopt.trainers import automodel_moe_peft_run as moe
from tests.adopt.trainers import tiny
from tests.daemon_helpers import free_port
from tests.gloo import launch

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("automodel_moe_peft")
    launch(moe.train, str(tmp / "train"), str(tmp / "ref"), free_port(), deadline_s=240)
    return tmp


def test_fused_expert_factors_are_published_as_written_and_load_as_trained(run, tmp_path):
    import torch
    import transformers as tf
    from peft.tuners.lora.layer import ParamWrapper
    from safetensors.torch import load_file

    ckpt = run / "train" / f"epoch_0_step_{tiny.STEPS}"
    written = json.loads((ckpt / "model" / "adapter_config.json").read_text())
    assert written["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    before = tree_digest(run / "train")

    res = watch_once(run / "train", tmp_path / "sink")
    out = res.stdout + res.stderr
    assert "1 step(s) published, 0 not" in out, out
    export = published(tmp_path / "sink", tiny.STEPS)
    assert json.loads((export / "adapter_config.json").read_text()) == written
    assert tree_digest(run / "train") == before

    base = tf.AutoModelForCausalLM.from_pretrained(run / "ref" / "base")
    model, loaded = _peft_loads(base, export)
    assert set(loaded) == set(load_file(export / "adapter_model.safetensors"))  # none missing, none left over

    trained = load_file(run / "ref" / "lora.safetensors")
    native = {"gate_up_proj": "lora_gate_and_up", "down_proj": "lora_down"}
    seen = set()
    for name, module in model.named_modules():
        if isinstance(module, ParamWrapper):
            # PEFT reads A as [experts, rank, in] and B as [out, rank, experts] (`get_delta_weight`);
            # AutoModel holds them as [experts, in, rank] and [experts, rank, out].
            layer = name.removeprefix("base_model.model.").split(".mlp.")[0]
            stem = f"{layer}.mlp.experts.{native[module.parameter_name]}"
            a, b = trained[f"{stem}_A"], trained[f"{stem}_B"]
            experts, _, rank = a.shape
            got_a = module.lora_A["default"].weight.reshape(experts, rank, -1)
            got_b = module.lora_B["default"].weight.reshape(-1, rank, experts)
            assert torch.equal(got_a, a.transpose(1, 2).to(got_a.dtype)), stem
            assert torch.equal(got_b, b.permute(2, 1, 0).to(got_b.dtype)), stem
            assert b.any(), stem  # trained: B starts at zero
            seen |= {f"{stem}_A", f"{stem}_B"}
    for name, value in trained.items():
        if name in seen:
            continue
        got = loaded["base_model.model." + name]
        assert torch.equal(got, value.to(got.dtype)), name
    assert len(seen) == 4 * moe.config().num_hidden_layers  # A and B of both projections, every layer


@pytest.mark.parametrize(
    ("hf_names", "moe_rank_scaling", "said"),
    [
        (
            False,
            False,
            "'base_model.model.model.layers.0.mlp.experts.lora_down_A' and 7 more are NeMo AutoModel's",
        ),
        (True, True, "AutoModel's moe_rank_scaling trained 'base_model.model.model.layers.0.mlp.experts."),
    ],
    ids=["grouped-layout", "moe-rank-scaling"],
)
def test_expert_factors_peft_would_not_load_are_refused_by_name(tmp_path, hf_names, moe_rank_scaling, said):
    launch(moe.train, str(tmp_path / "train"), "", free_port(), hf_names, moe_rank_scaling, world=1)
    ckpt = tmp_path / "train" / f"epoch_0_step_{tiny.STEPS}"
    config = json.loads((ckpt / "model" / "adapter_config.json").read_text())
    assert ("target_parameters" in config) is hf_names and "rank_pattern" not in config
    before = tree_digest(tmp_path / "train")

    res = watch_once(tmp_path / "train", tmp_path / "sink")
    out = res.stdout + res.stderr
    assert "0 step(s) published, 1 not" in out, out
    assert f"AdoptError: {said}" in out, out
    assert not published(tmp_path / "sink", tiny.STEPS).exists()
    assert tree_digest(tmp_path / "train") == before


def test_moe_rank_scaling_with_one_expert_per_token_keeps_r_and_is_published_given_the_config(tmp_path):
    """AutoModel trains the experts at `dim // n_activated_experts`: with top-1 routing that is r, which
    PEFT builds from adapter_config.json. Told so by the base's config.json, the adapter is published and
    loads; without it the rank is unknown, and refused."""
    import torch
    from safetensors.torch import load_file

    launch(moe.train, str(tmp_path / "train"), "", free_port(), True, True, 1, world=1)
    shutil.copytree(tmp_path / "train", tmp_path / "again")
    base_dir = tmp_path / "base"
    moe.config(top_k=1).save_pretrained(base_dir)

    res = watch_once(tmp_path / "train", tmp_path / "refused")
    out = res.stdout + res.stderr
    assert "AdoptError: AutoModel's moe_rank_scaling trained" in out and "config.json in --extras" in out, out

    res = watch_once(tmp_path / "again", tmp_path / "sink", "--extras", str(base_dir))
    out = res.stdout + res.stderr
    assert "1 step(s) published, 0 not" in out, out
    export = published(tmp_path / "sink", tiny.STEPS)
    assert not (export / "config.json").exists()  # read for its experts per token, never published
    written = load_file(export / "adapter_model.safetensors")
    experts = written["base_model.model.model.layers.0.mlp.experts.lora_A.weight"]
    assert experts.shape[0] == moe.RANK * moe.EXPERTS  # rank r: what PEFT builds

    import transformers as tf

    base = tf.Qwen3MoeForCausalLM(moe.config(top_k=1))
    _, loaded = _peft_loads(base, export)
    assert set(loaded) == set(written)
    assert all(torch.equal(loaded[k], v.to(loaded[k].dtype)) for k, v in written.items())


def test_moe_rank_scaling_with_two_experts_per_token_is_refused_though_the_config_says_so(tmp_path):
    launch(moe.train, str(tmp_path / "train"), "", free_port(), True, True, 2, world=1)
    moe.config(top_k=2).save_pretrained(tmp_path / "base")

    res = watch_once(tmp_path / "train", tmp_path / "sink", "--extras", str(tmp_path / "base"))
    out = res.stdout + res.stderr
    assert "0 step(s) published, 1 not" in out, out
    assert f"at rank r // 2 = {moe.RANK // 2}, but adapter_config.json gives them r={moe.RANK}" in out, out
    assert not published(tmp_path / "sink", tiny.STEPS).exists()


def _peft_loads(base: Any, export: Path) -> tuple[Any, dict[str, Any]]:
    """`PeftModel.from_pretrained(base, export)` and the LoRA tensors it loaded, under the file's names;
    PEFT warning of a key or shape it dropped fails the test."""
    from peft import PeftModel

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = PeftModel.from_pretrained(base, export)
    said = [str(w.message) for w in caught]
    assert not [m for m in said if "key" in m.lower() or "shape" in m.lower()], said
    return model, {k.replace(".default.", "."): v for k, v in model.state_dict().items() if ".lora_" in k}
