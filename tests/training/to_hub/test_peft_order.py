"""A LoRA model's merged export is sharded as `save_pretrained` of `merge_and_unload()` shards it: files
filled in the merged model's state-dict order, and its `num_parameters()` (without the LoRA matrices) in
the index. Before, the merged weights were packed last and the index counted the LoRA parameters too."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from stagerd.contract import layout

peft = pytest.importorskip("peft")


def _lora_llama(**lora_kw) -> torch.nn.Module:
    import transformers as tf

    config = tf.LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    base = tf.LlamaForCausalLM(config)
    lora_kw.setdefault("target_modules", ["q_proj", "v_proj"])
    lora = peft.LoraConfig(r=2, lora_alpha=4, task_type="CAUSAL_LM", **lora_kw)
    return peft.get_peft_model(base, lora)


def _saved_and_exported(model: torch.nn.Module, tmp_path: Path, **export_kw) -> Path:
    """Step 1 of `model` saved through the Stager with `model=`, then exported: the export's directory."""
    from stagerd import Stager
    from stagerd.engine.export import export_step

    with Stager(tmp_path / "root") as stager:
        stager.save(model.state_dict(), 1, model=model).result()
    return export_step(tmp_path / "root" / layout.step_dir_name(1), **export_kw).export_dir


def test_the_merged_export_is_sharded_as_save_pretrained_of_the_merged_model(tmp_path):

    model = _lora_llama()
    limit = 3000  # a few tensors per file, so order decides which file each lands in
    export = _saved_and_exported(model, tmp_path, max_shard_size=limit)

    ref = tmp_path / "ref"
    copy.deepcopy(model).merge_and_unload().save_pretrained(ref, max_shard_size=limit)
    index = "model.safetensors.index.json"
    assert len(json.loads((ref / index).read_text())["weight_map"]) > 10
    assert (export / index).read_bytes() == (ref / index).read_bytes()
    for f in sorted(ref.glob("*.safetensors")):  # the merged values differ by float rounding, not the layout
        n = 8 + int.from_bytes(f.read_bytes()[:8], "little")
        assert (export / f.name).read_bytes()[:n] == f.read_bytes()[:n], f.name


def test_a_modules_to_save_copy_is_exported_as_the_merged_models_own_module(tmp_path):
    """LoRA with `modules_to_save=["lm_head"]` (a head trained in full): merge_and_unload() puts the trained
    copy in the module's place. Before, the main export kept PEFT's names (`base_model.model.lm_head.
    modules_to_save.default.weight`, ...), which from_pretrained does not load: a model of random weights."""
    import transformers as tf

    from tests.fidelity import harness

    model = _lora_llama(modules_to_save=["lm_head"])
    with torch.no_grad():  # trained: the copy and the LoRA B matrices are no longer what they started as
        for n, p in model.named_parameters():
            if "modules_to_save" in n or "lora_B" in n:
                p.add_(torch.randn_like(p))
    limit = 3000
    export = _saved_and_exported(model, tmp_path, max_shard_size=limit)
    ref = tmp_path / "ref"
    merged = copy.deepcopy(model).merge_and_unload()
    merged.save_pretrained(ref, max_shard_size=limit)
    index = "model.safetensors.index.json"
    assert (export / index).read_bytes() == (ref / index).read_bytes()
    got, want = harness.tensors(export), harness.tensors(ref)
    assert sorted(got) == sorted(want)
    assert got["lm_head.weight"] == want["lm_head.weight"]  # the trained copy, bit for bit
    loaded, info = tf.AutoModelForCausalLM.from_pretrained(export, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, merged(ids).logits, rtol=1e-5, atol=1e-5)


def test_a_model_with_a_second_adapter_saves_and_exports_the_active_one(tmp_path):
    """A reference adapter beside the trained one (TRL's `ref_adapter_name`). Before, `Stager.save(...,
    model=)` raised HubPlanError on every save: the training stopped. Now adapter/ is what
    `PeftModel.save_pretrained` writes at its root (`default`; the other goes to a subfolder there, and is
    not exported, said in a warning), and the main export is `merge_and_unload()`: the active adapter
    merged, the other's tensors left out."""
    import transformers as tf

    from tests.fidelity import harness

    model = _lora_llama()
    ref_lora = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["v_proj", "o_proj"], task_type="CAUSAL_LM")
    model.add_adapter("reference", ref_lora)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.add_(torch.randn_like(p))
    export = _saved_and_exported(model, tmp_path)
    ref = tmp_path / "ref"
    model.save_pretrained(ref)
    for name in ("adapter_model.safetensors", "adapter_config.json"):
        assert (export / "adapter" / name).read_bytes() == (ref / name).read_bytes(), name
    merged = copy.deepcopy(model).merge_and_unload()
    merged.save_pretrained(tmp_path / "merged")
    assert sorted(harness.tensors(export)) == sorted(harness.tensors(tmp_path / "merged"))
    loaded = tf.AutoModelForCausalLM.from_pretrained(export)
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, merged(ids).logits, rtol=1e-5, atol=1e-5)


def _reordered_by_a_second_copy() -> set[str] | None:
    """A set of module names that iterates in another order once copied twice than once (two of its names
    collide in the hash table, and each copy swaps them), or None (never seen) for this hash seed. Only
    the config is written with it: the names need not be the model's."""
    import itertools

    stems = ("q", "k", "v", "o", "gate", "up", "down", "in", "out", "fc1", "fc2", "w1", "w2", "w3", "qkv")
    names = [f"{p}_proj" for p in stems]
    for n in (4, 5, 6):
        for chosen in itertools.combinations(names, n):
            s = set(chosen)
            if list(copy.deepcopy(s)) != list(copy.deepcopy(copy.deepcopy(s))):
                return s
    return None


def test_adapter_config_lists_target_modules_in_save_pretraineds_order(tmp_path):
    """PEFT writes `target_modules` (a set) as list(deepcopy(set)). Before, the config was deep-copied
    first, so the set was copied twice, and the list could come out in another order than in the
    adapter_config.json that `PeftModel.save_pretrained` writes in the same process."""

    targets = _reordered_by_a_second_copy()
    if targets is None:
        pytest.skip("no set of these names reorders under this hash seed")
    model = _lora_llama()
    model.peft_config["default"].target_modules = targets
    export = _saved_and_exported(model, tmp_path)
    model.save_pretrained(tmp_path / "ref")
    name = "adapter_config.json"
    assert (export / "adapter" / name).read_bytes() == (tmp_path / "ref" / name).read_bytes()


def test_a_lora_embedding_is_merged_as_merge_and_unload_merges_it(tmp_path):
    """LoRA on the input embeddings (new tokens learnt): W + scaling * (B @ A).T, A being (r x vocab).
    Before, the main export kept PEFT's names (`...embed_tokens.base_layer.weight`, `lora_embedding_A`),
    which from_pretrained does not load."""
    import transformers as tf

    from tests.fidelity import harness

    model = _lora_llama(target_modules=["q_proj", "embed_tokens"])
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora_" in n:
                p.add_(torch.randn_like(p))
    export = _saved_and_exported(model, tmp_path)
    merged = copy.deepcopy(model).merge_and_unload()
    merged.save_pretrained(tmp_path / "ref")
    got, want = harness.tensors(export), harness.tensors(tmp_path / "ref")
    assert sorted(got) == sorted(want)
    assert got["model.embed_tokens.weight"][:2] == want["model.embed_tokens.weight"][:2]
    loaded = tf.AutoModelForCausalLM.from_pretrained(export)
    torch.testing.assert_close(loaded.model.embed_tokens.weight, merged.model.embed_tokens.weight)
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, merged(ids).logits, rtol=1e-5, atol=1e-5)


def test_a_lora_model_whose_conversion_pads_with_zeros_is_merged(tmp_path):
    """Inkling2's checkpoint pads the vocabulary with zero rows. Before, the merged plan looked the zero
    fill up among the merged model's tensors: the main export fell back to PEFT's own names."""
    import transformers as tf

    from tests.fidelity import harness
    from tests.fidelity.registry import cases as registry
    from tests.fidelity.registry.check import build

    if not hasattr(tf, "Inkling2ForCausalLM"):
        pytest.skip(f"transformers {tf.__version__} has no Inkling2")
    base = build(registry.Case("inkling2_text", "Inkling2ForCausalLM", over=(("unpadded_vocab_size", 56),)))
    lora = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj.linear"], task_type="CAUSAL_LM")
    model = peft.get_peft_model(base, lora)
    export = _saved_and_exported(model, tmp_path)
    copy.deepcopy(model).merge_and_unload().save_pretrained(tmp_path / "ref")
    got, want = harness.tensors(export), harness.tensors(tmp_path / "ref")
    assert sorted(got) == sorted(want)
    assert all(got[k] == want[k] for k in want if "q_proj" not in k)  # the LoRA B is zero: all bit for bit
