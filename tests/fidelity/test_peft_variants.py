"""DoRA, LoRA biases and plain LoRA on GPT-2's Conv1D and embeddings, saved through the Stager with
`model=` and exported: the main export is `save_pretrained` of `merge_and_unload()` (its keys, index,
layout, every tensor bit for bit, DoRA's too), which `from_pretrained` loads;
`adapter/` is what `PeftModel.save_pretrained` writes, which `PeftModel.from_pretrained` loads bit for
bit. Before, the main export kept PEFT's in-memory names (`...q_proj.base_layer.weight`,
`lora_magnitude_vector`) with a warning, so `from_pretrained` loaded a model without the trained
weights."""

from __future__ import annotations

import copy
import warnings
from pathlib import Path

import pytest
import torch

from stagerd.contract import commit_marker, layout
from stagerd.engine import merge
from tests.fidelity import harness
from tests.fidelity.ulps import ulps

peft = pytest.importorskip("peft")
tf = pytest.importorskip("transformers")

SHARD = 6000  # a few tensors per file: the index and each file's place are save_pretrained's
IDS = torch.tensor([[1, 5, 9, 2, 7, 3]])
# (base dtype, PEFT's autocast of the adapter to float32): the merge's promotions and roundings differ
DTYPES = {"f32": (torch.float32, True), "bf16_base": (torch.bfloat16, True), "bf16": (torch.bfloat16, False)}


def _model(dtype: str, **lora_kw) -> torch.nn.Module:
    config = tf.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=52,  # down_proj's rows end in a tail after torch's last whole vector (8 or 16)
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        tie_word_embeddings=False,
        attention_bias=True,  # a base bias for lora_bias to merge into
    )
    torch.manual_seed(0)
    base_dtype, autocast = DTYPES[dtype]
    base = tf.LlamaForCausalLM(config).to(base_dtype)
    lora = peft.LoraConfig(r=4, lora_alpha=8, task_type="CAUSAL_LM", **lora_kw)
    model = peft.get_peft_model(base, lora, autocast_adapter_dtype=autocast)
    return _trained(model)


def _trained(model: torch.nn.Module) -> torch.nn.Module:
    """As if trained: B no longer zero, the magnitude no longer the base's norm."""
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_magnitude_vector" in n:
                p.mul_(1 + 0.2 * torch.rand_like(p))
            elif ".lora_" in n:
                p.add_(0.3 * torch.randn_like(p))
    return model.eval()


def _saved_and_exported(model, tmp: Path, block_bytes: int | None = None) -> tuple[Path, Path]:
    from stagerd import Stager
    from stagerd.engine.export import export_step

    with Stager(tmp / "root") as stager:
        stager.save(model.state_dict(), 1, model=model).result()
    step = tmp / "root" / layout.step_dir_name(1)
    plan = commit_marker.read_marker(step).hub_plan  # merged, not the fallback to PEFT's own names
    assert plan is not None and plan.origin == "peft" and plan.merges
    with pytest.MonkeyPatch.context() as mp:
        if block_bytes is not None:
            mp.setattr(merge, "BLOCK_BYTES", block_bytes)
        return export_step(step, max_shard_size=SHARD).export_dir, step


def _check(model, export: Path, tmp: Path, merged_suffixes: tuple[str, ...]) -> None:
    """Every claim for one model: each merged tensor bit for bit as PEFT's."""
    merged = copy.deepcopy(model).merge_and_unload()
    merged.save_pretrained(tmp / "ref", max_shard_size=SHARD)
    assert (export / layout.INDEX_NAME).read_bytes() == (tmp / "ref" / layout.INDEX_NAME).read_bytes()
    got, want = harness.tensors(export), harness.tensors(tmp / "ref")
    assert sorted(got) == sorted(want)
    names = [k for k in want if k.endswith(merged_suffixes)]
    assert names
    for name, entry in want.items():
        assert got[name][:2] == entry[:2], name
        assert got[name][2] == entry[2], (f"{name}: bytes differ", name in names and ulps(got[name], entry))
    for f in sorted((tmp / "ref").glob("*.safetensors")):  # each tensor in save_pretrained's file and place
        n = 8 + int.from_bytes(f.read_bytes()[:8], "little")
        assert (export / f.name).read_bytes()[:n] == f.read_bytes()[:n], f.name
    loaded, info = tf.AutoModelForCausalLM.from_pretrained(export, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    with torch.no_grad():
        logits = loaded.eval()(IDS).logits.float()
        tol = 1e-4 if loaded.dtype == torch.float32 else 5e-2
        torch.testing.assert_close(logits, merged(IDS).logits.float(), rtol=tol, atol=tol)
        torch.testing.assert_close(logits, model(IDS).logits.float(), rtol=tol, atol=tol)
    _check_adapter(model, export / "adapter", tmp / "adapter_ref")


def _check_adapter(model, adapter: Path, ref: Path) -> None:
    """adapter/ is PeftModel.save_pretrained's, magnitude vectors and LoRA biases included, and loads."""
    model.save_pretrained(ref)
    for name in ("adapter_model.safetensors", "adapter_config.json"):
        assert (adapter / name).read_bytes() == (ref / name).read_bytes(), name
    saved = harness.tensors(ref)
    torch.manual_seed(1)  # another base init: only the adapter's tensors are compared
    wrapped = model.get_base_model()
    base = type(wrapped)(copy.deepcopy(wrapped.config)).to(wrapped.dtype)
    loaded = peft.PeftModel.from_pretrained(base, adapter)
    want = {k.replace(".default", ""): v for k, v in model.state_dict().items() if ".lora_" in k}
    got = {k.replace(".default", ""): v for k, v in loaded.state_dict().items() if ".lora_" in k}
    assert sorted(got) == sorted(want) and len(saved) == len(got)
    for k, v in want.items():  # PEFT may load a bf16 adapter as float32: exactly, then
        assert torch.equal(got[k], v.to(got[k].dtype)), k


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_a_dora_model_exports_as_merge_and_unload_writes_it(tmp_path, dtype):
    model = _model(dtype, target_modules=["q_proj", "v_proj", "down_proj"], use_dora=True)
    assert any("lora_magnitude_vector" in k for k in model.state_dict())
    export, _ = _saved_and_exported(model, tmp_path, block_bytes=200)  # several row blocks per weight
    _check(model, export, tmp_path, ("q_proj.weight", "v_proj.weight", "down_proj.weight"))


def _gpt2(dtype: str, **lora_kw) -> torch.nn.Module:
    """GPT-2, its Conv1D (in x out, `fan_in_fan_out`) and input embeddings LoRA-tuned, trained."""
    config = tf.GPT2Config(
        vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2, tie_word_embeddings=False
    )
    torch.manual_seed(0)
    base_dtype, autocast = DTYPES[dtype]
    lora = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["c_attn", "wte"], fan_in_fan_out=True, **lora_kw
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PEFT on Conv1D and embeddings says what it sets
        model = peft.get_peft_model(
            tf.GPT2LMHeadModel(config).to(base_dtype), lora, autocast_adapter_dtype=autocast
        )
    return _trained(model)


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_a_dora_embedding_and_fan_in_fan_out_layer_are_merged(tmp_path, dtype):
    """Each output of GPT-2's Conv1D and embeddings is a column of the weight, whose norm is summed over
    every row block before any row is written."""
    model = _gpt2(dtype, use_dora=True)
    export, _ = _saved_and_exported(model, tmp_path, block_bytes=200)
    _check(model, export, tmp_path, ("c_attn.weight", "wte.weight"))


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_lora_on_an_embedding_and_fan_in_fan_out_layer_is_bit_for_bit(tmp_path, dtype):
    """PEFT's Embedding casts its delta to the base's dtype before adding it, its Linear does not: a
    float32 adapter on a bf16 base rounds twice in one, once in the other."""
    model = _gpt2(dtype)
    export, _ = _saved_and_exported(model, tmp_path, block_bytes=200)
    _check(model, export, tmp_path, ("c_attn.weight", "wte.weight"))


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_lora_biases_are_merged_into_the_base_bias(tmp_path, dtype):
    model = _model(dtype, target_modules=["q_proj", "v_proj"], lora_bias=True)
    assert any(".lora_B.default.bias" in k for k in model.state_dict())
    export, _ = _saved_and_exported(model, tmp_path)
    _check(model, export, tmp_path, ("q_proj.weight", "v_proj.weight", "q_proj.bias", "v_proj.bias"))


def test_verify_recomputes_dora_and_bias_merges_and_names_a_flipped_byte(tmp_path):
    from stagerd.engine.verify import verify_export
    from stagerd.errors import VerifyError

    for kind, kw in {"dora": {"use_dora": True}, "bias": {"lora_bias": True}}.items():
        model = _model("f32", target_modules=["q_proj", "v_proj"], **kw)
        export, step = _saved_and_exported(model, tmp_path / kind)
        verify_export(export, step)
        name = "model.layers.1.self_attn.v_proj." + ("bias" if kind == "bias" else "weight")
        harness.flip_byte(export, name)
        with pytest.raises(VerifyError) as e:
            verify_export(export, step)
        assert f"tensor {name!r} (its byte 5) differs" in e.value.message, (kind, e.value.message)
