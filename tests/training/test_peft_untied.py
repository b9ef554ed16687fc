"""A tied model (`tie_word_embeddings=True`, new tokens added) trained with LoRA and `modules_to_save` on
its embeddings and output layer, without `ensure_weight_tying`: PEFT trains a copy of each, and
`merge_and_unload()` unties them, writing `tie_word_embeddings: false`. The merged export is what
`save_pretrained` of `merge_and_unload()` writes, byte for byte (weights, index and config.json), and
loads untied with the trained copies.

Before, a copy of one side only was refused (the main export kept PEFT's names, which do not load as
the model), and copies of both were merged with the base model's config.json: `tie_word_embeddings:
true`, which transformers 5 overrides with a warning (both weights present, with other values), but a
loader that follows the flag ties the output layer to the embeddings, the trained one lost.
A float32 copy in a bfloat16 model (cast by the user: PEFT keeps a copy in its original's dtype) made the
merged model float32 (its first parameter), where the config said bfloat16, and one side's copy made the
index count the weight left on the original once, under the original."""

from __future__ import annotations

import copy
import json
import warnings

import pytest

from stagerd.contract import commit_marker, layout
from tests.fidelity import harness
from tests.training.tiny_llama import tiny_llama, trained

pytest.importorskip("peft")

LIMIT = 3000  # a few tensors per file: the index, with its parameter count, is written and compared


def _build(modules: list[str], dtype: str, copies_in: str | None):
    import peft
    import torch

    base = tiny_llama(dtype=dtype)
    base.resize_token_embeddings(66, mean_resizing=False)  # new special tokens: still tied
    assert base.lm_head.weight is base.model.embed_tokens.weight
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], modules_to_save=modules)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PEFT's own warning about a tied layer without ensure_weight_tying
        model = peft.get_peft_model(base, lora)
    if copies_in is not None:
        for n, m in model.named_modules():
            if n.endswith("modules_to_save.default"):
                m.to(getattr(torch, copies_in))
    return trained(model)


def _export(model, root):
    from stagerd import Stager
    from stagerd.engine.export import export_step

    with Stager(root) as stager:
        stager.save(model.state_dict(), 1, model=model).result()
    step = root / layout.step_dir_name(1)
    plan = commit_marker.read_marker(step).hub_plan
    assert plan is not None and plan.origin == "peft"  # merged, not the fallback to PEFT's own names
    return export_step(step, max_shard_size=LIMIT).export_dir


@pytest.mark.parametrize(
    ("modules", "dtype", "copies_in"),
    [
        (["embed_tokens", "lm_head"], "float32", None),
        (["embed_tokens", "lm_head"], "bfloat16", None),
        (["embed_tokens", "lm_head"], "bfloat16", "float32"),
        (["embed_tokens"], "float32", None),
        (["embed_tokens"], "bfloat16", "float32"),
        (["lm_head"], "float32", None),
    ],
)
def test_copies_of_tied_embeddings_export_untied_as_merge_and_unload(modules, dtype, copies_in, tmp_path):
    import torch
    import transformers as tf

    model = _build(modules, dtype, copies_in)
    out = _export(model, tmp_path / "root")

    ref = tmp_path / "ref"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PEFT's: "no longer tied after merging"
        merged = copy.deepcopy(model).merge_and_unload()
    assert merged.lm_head.weight is not merged.get_input_embeddings().weight
    merged.save_pretrained(ref, max_shard_size=LIMIT)
    assert json.loads((ref / "config.json").read_text())["tie_word_embeddings"] is False
    harness.assert_same_tensors(out, ref)
    harness.assert_same_weight_files(out, ref)
    for name in ("config.json", "generation_config.json"):
        assert (out / name).read_bytes() == (ref / name).read_bytes(), name
    assert model.get_base_model().config.tie_word_embeddings is True  # the live model is left as it was

    loaded = tf.AutoModelForCausalLM.from_pretrained(out)
    assert loaded.lm_head.weight is not loaded.get_input_embeddings().weight
    wrapped = model.base_model.model
    for got, module in (
        (loaded.lm_head, wrapped.lm_head),
        (loaded.model.embed_tokens, wrapped.model.embed_tokens),
    ):
        want = module.modules_to_save["default"] if hasattr(module, "modules_to_save") else module
        assert torch.equal(got.weight, want.weight)  # the trained copy, or the original where none


def test_the_adapter_is_what_peft_model_save_pretrained_writes(tmp_path):
    model = _build(["embed_tokens", "lm_head"], "bfloat16", None)
    out = _export(model, tmp_path / "root")
    model.save_pretrained(tmp_path / "ref")
    for name in ("adapter_model.safetensors", "adapter_config.json"):
        assert (out / "adapter" / name).read_bytes() == (tmp_path / "ref" / name).read_bytes(), name


def test_the_trainer_integrations_config_is_the_merged_models(tmp_path):
    """The Trainer's and Lightning's callbacks hand config.json as an extra (`hf_files.model_files`): it
    is the merged model's too, since the export given it does not write its own."""
    from stagerd.integrations import hf_files

    model = _build(["embed_tokens"], "bfloat16", "float32")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        copy.deepcopy(model).merge_and_unload().save_pretrained(tmp_path / "ref")
    files = hf_files.model_files(model)
    assert files["config.json"] == (tmp_path / "ref" / "config.json").read_bytes()
