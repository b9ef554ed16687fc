"""A MoE's fused experts LoRA-tuned with `target_parameters` (PEFT's `ParamWrapper`), attention with
`target_modules`, a few optimizer steps, saved through the Stager with `model=` and exported: the main
export is `save_pretrained` of `merge_and_unload()` (its keys, index, layout and every tensor bit for bit,
the merged experts and attention too), which `from_pretrained` loads, and
`adapter/` is what `PeftModel.save_pretrained` writes. Before, the plan refused a `ParamWrapper`: the
main export kept PEFT's names with a warning and `from_pretrained` loaded the base experts without the
fine-tune.

Qwen3-MoE and Mixtral hold their experts [experts, out, in], saved one tensor per expert (Qwen3-MoE's
router, a 2-dim parameter, is one matrix), GPT-OSS [experts, in, out] (`is_transposed`); each in float32
and bf16, with PEFT's float32 adapter on the bf16 base and a bf16 one (no autocast): each rounds
differently."""

from __future__ import annotations

import copy
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from stagerd.contract import commit_marker, layout
from stagerd.contract.lora_merge import ExpertLayout, MergeKind
from stagerd.engine import merge
from tests.fidelity import harness, models
from tests.fidelity.ulps import ulps

peft = pytest.importorskip("peft")
tf = pytest.importorskip("transformers")

pytestmark = pytest.mark.slow

SHARD = 20000  # a few tensors per file: the index and each file's place are save_pretrained's
# (base dtype, PEFT's autocast of the adapter to float32)
DTYPES = {"f32": (torch.float32, True), "bf16_base": (torch.bfloat16, True), "bf16": (torch.bfloat16, False)}
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def _base(kind: str) -> torch.nn.Module:
    if kind != "gpt_oss":
        return models.build(kind)
    config = tf.GptOssConfig(
        vocab_size=models.VOCAB,
        hidden_size=32,
        intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    return tf.GptOssForCausalLM(config)


def _trained(
    kind: str, dtype: str, params: list[str], modules: Any = ("q_proj", "v_proj")
) -> torch.nn.Module:
    """`kind`'s LoRA model after a few AdamW steps: B is no longer zero."""
    torch.manual_seed(0)
    base_dtype, autocast = DTYPES[dtype]
    base = _base(kind).to(base_dtype)
    targets = modules if isinstance(modules, str) else list(modules)
    lora = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=targets, target_parameters=params, task_type="CAUSAL_LM"
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PEFT says target_parameters is experimental
        model = peft.get_peft_model(base, lora, autocast_adapter_dtype=autocast)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.05)
    ids = torch.randint(0, models.VOCAB, (2, 12))
    model.train()
    for _ in range(3):
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    assert all(p.abs().sum() > 0 for n, p in model.named_parameters() if "lora_B" in n)
    return model.eval()


def _saved_and_exported(model, tmp: Path) -> tuple[Path, Path]:
    from stagerd import Stager
    from stagerd.engine.export import export_step

    with Stager(tmp / "root") as stager:
        stager.save(model.state_dict(), 1, model=model).result()
    step = tmp / "root" / layout.step_dir_name(1)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(merge, "BLOCK_BYTES", 200)  # several row blocks per expert
        return export_step(step, max_shard_size=SHARD).export_dir, step


def _check(model, export: Path, tmp: Path) -> set[str]:
    """Every claim for one model; the tensors the merge changed."""
    merged = copy.deepcopy(model).merge_and_unload()
    merged.save_pretrained(tmp / "ref", max_shard_size=SHARD)
    assert (export / layout.INDEX_NAME).read_bytes() == (tmp / "ref" / layout.INDEX_NAME).read_bytes()
    got, want = harness.tensors(export), harness.tensors(tmp / "ref")
    assert sorted(got) == sorted(want)
    copy.deepcopy(model).unload().save_pretrained(tmp / "unmerged", max_shard_size=SHARD)
    before = harness.tensors(tmp / "unmerged")
    changed = set()
    for name, entry in want.items():
        assert got[name][:2] == entry[:2], name
        # expert and Linear merges sum as torch does (engine/torch_sum.py): bit for bit, as every other one
        assert got[name][2] == entry[2], f"{name}: {ulps(got[name], entry):.2f} ulps from PEFT's"
        if before[name][2] != entry[2]:
            changed.add(name)
    assert any(".experts." in n for n in changed), "the merge changed no expert"
    for f in sorted((tmp / "ref").glob("*.safetensors")):  # each tensor in save_pretrained's file and place
        n = 8 + int.from_bytes(f.read_bytes()[:8], "little")
        assert (export / f.name).read_bytes()[:n] == f.read_bytes()[:n], f.name
    loaded, info = tf.AutoModelForCausalLM.from_pretrained(export, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    ids = torch.tensor([[1, 5, 9, 2, 7, 3]])
    with torch.no_grad():
        logits = loaded.eval()(ids).logits.float()
        tol = 1e-4 if loaded.dtype == torch.float32 else 5e-2
        torch.testing.assert_close(logits, merged(ids).logits.float(), rtol=tol, atol=tol)
        if loaded.dtype == torch.float32:  # in bf16 the merge's rounding may flip a router's top-k pick
            torch.testing.assert_close(logits, model(ids).logits.float(), rtol=tol, atol=tol)
    model.save_pretrained(tmp / "adapter_ref")  # adapter/: the experts' A and B as PEFT saves them
    for name in ("adapter_model.safetensors", "adapter_config.json"):
        assert (export / "adapter" / name).read_bytes() == (tmp / "adapter_ref" / name).read_bytes(), name
    return changed


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral", "gpt_oss"])
def test_lora_on_fused_experts_exports_as_merge_and_unload_writes_it(tmp_path, kind, dtype):
    params = EXPERTS + (["mlp.gate.weight"] if kind == "qwen3_moe" else [])
    model = _trained(kind, dtype, params)
    export, step = _saved_and_exported(model, tmp_path)
    plan = commit_marker.read_marker(step).hub_plan  # merged, not the fallback to PEFT's own names
    assert plan is not None and plan.origin == "peft"
    experts = {(m.experts > 1, m.layout) for m in plan.merges if m.kind is MergeKind.EXPERTS}
    layouts = {
        "qwen3_moe": {(True, ExpertLayout.EOI), (False, ExpertLayout.EOI)},
        "mixtral": {(True, ExpertLayout.EOI)},
    }
    assert experts == layouts.get(kind, {(True, ExpertLayout.EIO)})
    changed = _check(model, export, tmp_path)
    assert kind != "qwen3_moe" or any(n.endswith("mlp.gate.weight") for n in changed)  # the router too


def test_all_linear_on_a_moe_merges_its_experts_too(tmp_path):
    """PEFT's `all-linear` wraps the fused experts too (a `ParamWrapper` each): merged like the rest."""
    model = _trained("qwen3_moe", "f32", [], modules="all-linear")
    export, step = _saved_and_exported(model, tmp_path)
    plan = commit_marker.read_marker(step).hub_plan
    assert plan is not None and any(m.kind is MergeKind.EXPERTS for m in plan.merges)
    _check(model, export, tmp_path)


def test_verify_recomputes_expert_merges_and_names_a_flipped_byte(tmp_path):
    from stagerd.engine.verify import verify_export
    from stagerd.errors import VerifyError

    model = _trained("gpt_oss", "f32", EXPERTS)
    export, step = _saved_and_exported(model, tmp_path)
    verify_export(export, step)
    name = "model.layers.1.mlp.experts.down_proj"
    harness.flip_byte(export, name)
    with pytest.raises(VerifyError) as e:
        verify_export(export, step)
    assert f"tensor {name!r} (its byte 5) differs" in e.value.message, e.value.message


def _whisper_conv() -> torch.nn.Module:
    config = tf.WhisperConfig(
        vocab_size=models.VOCAB,
        d_model=16,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=16,
        decoder_ffn_dim=16,
        num_mel_bins=8,
        max_source_positions=16,
        max_target_positions=16,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        decoder_start_token_id=1,
    )
    lora = peft.LoraConfig(r=2, target_modules=["conv1", "q_proj"])
    return peft.get_peft_model(tf.WhisperForConditionalGeneration(config), lora)


def _one_expert() -> torch.nn.Module:
    """GPT-OSS with one expert, [1, in, out]: PEFT merges it as a Linear's out x in delta, which fits
    only by broadcasting, transposed, a square parameter."""
    config = tf.GptOssConfig(
        vocab_size=models.VOCAB,
        hidden_size=32,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_local_experts=1,
        num_experts_per_tok=1,
        max_position_embeddings=64,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    lora = peft.LoraConfig(r=2, target_parameters=["mlp.experts.gate_up_proj"])
    return peft.get_peft_model(tf.GptOssForCausalLM(config), lora)


@pytest.mark.parametrize(
    ("build", "words"),
    [
        (_whisper_conv, "only LoRA and DoRA Linear and Embedding layers are merged"),
        (_one_expert, "a [1, 32, 32] parameter is not one PEFT merges by expert"),
    ],
)
def test_a_lora_stagerd_does_not_merge_keeps_peft_names_with_a_warning(tmp_path, caplog, build, words):
    """A convolution's LoRA (as before) and one expert held in x out are refused by the plan: the main
    export keeps PEFT's names, a warning says why, the save goes on."""
    from stagerd import Stager

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = build()
    with Stager(tmp_path / "root") as stager:
        stager.save(model.state_dict(), 1, model=model).result()
    plan = commit_marker.read_marker(tmp_path / "root" / layout.step_dir_name(1)).hub_plan
    assert plan is None or not plan.merges
    assert any("keeps the PEFT model's own names" in r.message and words in r.message for r in caplog.records)
