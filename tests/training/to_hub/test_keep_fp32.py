"""A cast export leaves in their saved dtype the tensors transformers keeps in float32 for that dtype
(`_keep_in_fp32_modules_strict` under bf16 and fp16, `_keep_in_fp32_modules` under fp16 too): its files
are `save_pretrained` of the model `from_pretrained` loads in that dtype. Before, a DeepSeek V3 export in
bf16 rounded the router gate and its score bias to bf16, which that save writes in float32."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from stagerd import Stager
from stagerd.contract import layout
from stagerd.contract.hub_plan import HubPlan
from stagerd.contract.marker_json import decode_plan, encode_plan
from stagerd.engine.adopt.export import export_adopted
from stagerd.engine.adopt.source import AdoptOptions
from stagerd.engine.export import export_step
from stagerd.engine.verify import verify_export
from stagerd.errors import HubPlanError
from tests.fidelity.harness import assert_same_weight_files, config_dtype, dtype_fields, tensors
from tests.fidelity.registry.tiny import tiny_config

pytestmark = [
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
    pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"),
]


def _model(model_type: str, cls: str) -> Any:
    import torch
    import transformers as tf

    torch.manual_seed(0)
    cfg = tiny_config(model_type)
    if hasattr(cfg, "first_k_dense_replace"):  # its one layer a MoE layer, which has the router
        cfg = tiny_config(model_type, first_k_dense_replace=0)
    model = getattr(tf, cls)(cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # every floating tensor drawn, the zero score bias too: a rounding would show
        for t in [*model.parameters(), *model.buffers()]:
            if t.is_floating_point():
                t.copy_(torch.randn(t.shape, generator=g))
    return model.eval()


def _reference(model: Any, tmp: Path, dtype: str) -> Path:
    """save_pretrained of `model` as from_pretrained loads it in `dtype`."""
    import torch

    model.save_pretrained(tmp / "fp32")
    loaded = type(model).from_pretrained(tmp / "fp32", dtype=getattr(torch, dtype))
    loaded.save_pretrained(tmp / dtype)
    return tmp / dtype


def _staged(model: Any, tmp: Path) -> Path:
    with Stager(tmp / "root", checkpointer="thread") as stager:
        stager.save(model.state_dict(), step=1, model=model)
        stager.wait()
    return tmp / "root" / layout.step_dir_name(1)


def _dtypes(export: Path) -> dict[str, str]:
    return {n: dt for n, (dt, _, _) in tensors(export).items()}


@pytest.mark.parametrize(
    ("model_type", "cls", "kept"),
    [
        ("deepseek_v3", "DeepseekV3ForCausalLM", {"mlp.gate.weight", "mlp.gate.e_score_correction_bias"}),
        ("glm4_moe", "Glm4MoeForCausalLM", {"mlp.gate.weight", "mlp.gate.e_score_correction_bias"}),
    ],
)
def test_a_bf16_export_keeps_the_router_in_float32_as_from_pretrained_does(tmp_path, model_type, cls, kept):
    model = _model(model_type, cls)
    ref = _reference(model, tmp_path, "bfloat16")
    step = _staged(model, tmp_path)
    export = export_step(step, dtype="BF16", threads=1).export_dir
    assert_same_weight_files(export, ref)
    assert config_dtype(export) == config_dtype(ref) == "bfloat16"  # named by its main dtype
    got = _dtypes(export)
    f32 = {n for n, dt in got.items() if dt == "F32"}
    assert f32 and {n.split(".", 3)[-1] for n in f32} <= kept, f32  # model.layers.N.<kept>
    assert set(got.values()) == {"F32", "BF16"}
    assert verify_export(export, step).tensors == len(got)


def test_a_module_holding_the_model_keeps_its_router_too(tmp_path):
    """A LightningModule's model sits under a prefix of the saved keys; the lists name the model's own."""
    import torch

    class Holder(torch.nn.Module):
        def __init__(self, inner: Any) -> None:
            super().__init__()
            self.net = inner

    model = _model("glm4_moe", "Glm4MoeForCausalLM")
    ref = _reference(model, tmp_path, "bfloat16")
    step = _staged(Holder(model), tmp_path)
    export = export_step(step, dtype="BF16", threads=1).export_dir
    assert_same_weight_files(export, ref)
    assert "F32" in _dtypes(export).values()


def test_the_adopted_checkpoint_of_a_deepseek_v3_keeps_its_router_too(tmp_path):
    import torch.distributed.checkpoint as dcp

    from stagerd.daemon.hf_names import model_plan

    model = _model("deepseek_v3", "DeepseekV3ForCausalLM")
    ref = _reference(model, tmp_path, "bfloat16")
    ckpt = tmp_path / "adopted" / "step-1"
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(ckpt), no_dist=True)
    model.config.save_pretrained(ckpt)
    options = AdoptOptions(model_plan=model_plan)
    export_adopted(ckpt, tmp_path / "work", options, dtype="BF16")
    export = tmp_path / "work" / "export"
    assert_same_weight_files(export, ref)
    assert config_dtype(export) == config_dtype(ref) == "bfloat16"
    assert "F32" in _dtypes(export).values()


def test_fp16_keeps_t5s_wo_and_bf16_does_not(tmp_path):
    """T5 lists `wo` as non-strict: float32 under fp16 only."""
    model = _model("t5", "T5ForConditionalGeneration")
    step = _staged(model, tmp_path)
    for dtype, cast in (("float16", "F16"), ("bfloat16", "BF16")):
        ref = _reference(model, tmp_path / dtype, dtype)
        export = export_step(step, dtype=cast, threads=1).export_dir
        assert_same_weight_files(export, ref)
        assert config_dtype(export) == config_dtype(ref) == dtype
        f32 = {n for n, dt in _dtypes(export).items() if dt == "F32"}
        assert (dtype == "float16") == bool(f32), f32
        assert all(n.endswith(".wo.weight") for n in f32), f32


def test_keep_dtype_adds_to_the_models_list_and_a_llama_casts_everything(tmp_path):
    model = _model("llama", "LlamaForCausalLM")
    step = _staged(model, tmp_path)
    export = export_step(step, dtype="BF16", threads=1).export_dir
    assert set(_dtypes(export).values()) == {"BF16"}
    assert_same_weight_files(export, _reference(model, tmp_path, "bfloat16"))

    moe = _model("deepseek_v3", "DeepseekV3ForCausalLM")
    step = _staged(moe, tmp_path / "moe")
    export = export_step(step, dtype="BF16", keep_dtype=r"norm", threads=1).export_dir
    f32 = {n for n, dt in _dtypes(export).items() if dt == "F32"}
    assert any("norm" in n for n in f32) and any(n.endswith("gate.weight") for n in f32), f32


def test_the_marker_carries_the_lists_in_either_form_and_refuses_a_non_target():
    plan = HubPlan(uncast=(("BF16", ("a",)), ("F16", ("a", "b"))), dtype_from="a")
    for d in (plan.to_json(), encode_plan(plan, ["a", "b"])):
        back = decode_plan(json.loads(json.dumps(d)), ["a", "b"], path=None)
        assert back.uncast_for("F16") == ("a", "b") and back.uncast_for("BF16") == ("a",)
        assert back.dtype_from == "a"
        assert back.uncast_for("F32") == () and back.uncast_for(None) == ()
    bad = {**plan.to_json(), "uncast": {"I8": ["a"]}}
    with pytest.raises(HubPlanError, match="no cast target"):
        HubPlan.from_json(bad)


@pytest.mark.parametrize("saved", [None, ["gate"]])
def test_a_lora_models_merged_export_keeps_the_base_models_router(tmp_path, saved):
    """PEFT's merged export is `merge_and_unload()`'s model: as from_pretrained loads it in bf16. A router
    trained as a `modules_to_save` copy is the copy, kept too; before, its score bias (a buffer the
    wrapper does not answer for) failed the plan and the export kept PEFT's names, all in bf16."""
    import copy

    import peft
    import torch

    model = _model("deepseek_v3", "DeepseekV3ForCausalLM")
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_a_proj", "o_proj"], init_lora_weights=False)
    lora.modules_to_save = saved
    wrapped = peft.get_peft_model(model, lora)
    with torch.no_grad():  # the copy trained apart from the original
        for n, t in wrapped.named_parameters():
            if ".modules_to_save." in n:
                t.mul_(0.5)
    ref = _reference(copy.deepcopy(wrapped).merge_and_unload(), tmp_path, "bfloat16")
    export = export_step(_staged(wrapped, tmp_path), dtype="BF16", threads=1).export_dir
    assert_same_weight_files(export, ref)
    assert "F32" in _dtypes(export).values()


def test_a_composite_models_sub_configs_name_the_cast_where_the_model_is_named_float32(tmp_path):
    """BLIP-2 keeps query_tokens, its first parameter, and its Q-Former in float32 under fp16:
    save_pretrained names the model float32, and each sub-config (the Q-Former's too) float16, the dtype
    from_pretrained loaded it in. Before, the export named its sub-configs no dtype."""
    import torch

    model = _model("blip-2", "Blip2ForConditionalGeneration")
    ref = _reference(model, tmp_path, "float16")
    export = export_step(_staged(model, tmp_path), dtype="F16", threads=1).export_dir
    assert_same_weight_files(export, ref)
    got, want = (json.loads((d / "config.json").read_bytes()) for d in (export, ref))
    assert dtype_fields(got) == dtype_fields(want)
    assert want["dtype"] == "float32" and want["qformer_config"]["dtype"] == "float16"
    for kw in ({}, {"dtype": torch.float16}):  # as the Hub's client loads either
        a, b = (type(model).from_pretrained(d, **kw) for d in (export, ref))
        assert a.config.to_diff_dict() == b.config.to_diff_dict()
        assert {n: p.dtype for n, p in a.named_parameters()} == {n: p.dtype for n, p in b.named_parameters()}


def test_an_adopted_composite_checkpoint_names_its_sub_configs_the_cast(tmp_path):
    """A DCP save of a Llava, its config.json beside it, exported in bf16: the config.json is
    save_pretrained's of the model from_pretrained loads in bf16, each sub-config named bfloat16."""
    import torch
    import torch.distributed.checkpoint as dcp

    from stagerd.daemon.hf_names import model_plan

    model = _model("llava", "LlavaForConditionalGeneration")
    ref = _reference(model, tmp_path, "bfloat16")
    ckpt = tmp_path / "adopted" / "step-1"
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(ckpt), no_dist=True)
    model.config.save_pretrained(ckpt)
    export_adopted(ckpt, tmp_path / "work", AdoptOptions(model_plan=model_plan), dtype="BF16")
    export = tmp_path / "work" / "export"
    assert_same_weight_files(export, ref)
    got, want = (json.loads((d / "config.json").read_bytes()) for d in (export, ref))
    assert dtype_fields(got) == dtype_fields(want)
    assert {want["text_config"]["dtype"], want["vision_config"]["dtype"]} == {"bfloat16"}
    a, b = (type(model).from_pretrained(d) for d in (export, ref))
    assert a.config.to_diff_dict() == b.config.to_diff_dict() and a.dtype == b.dtype == torch.bfloat16
