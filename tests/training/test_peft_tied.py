"""A PEFT model of a tied Llama (`tie_word_embeddings=True`) whose adapter touches the tied embeddings.

With `ensure_weight_tying=True`, a `modules_to_save` copy of the embeddings is the output layer's too:
`merge_and_unload()` keeps them tied, and the merged export is its `save_pretrained`, byte for byte
(before, every tied copy was refused). Where merge_and_unload() does not give the trained model, the
export keeps PEFT's names, with a warning that says why: LoRA on a tied weight is merged into the one
shared weight, so the tied layer changes too (with `ensure_weight_tying=True` the same delta is merged
twice), and so are trainable tokens the tied layer does not share (other indices, or none of its own).
(A copy without `ensure_weight_tying`, which the merge unties: test_peft_untied.py.) Before, tokens
with other indices on the two tied layers were planned, and the export failed on the plan."""

from __future__ import annotations

import copy

import pytest

from stagerd.contract import commit_marker, layout
from stagerd.engine.export import build_export
from stagerd.engine.source import open_source
from tests.fidelity import harness
from tests.training.tiny_llama import tiny_llama, trained

pytest.importorskip("peft")


def _build(dtype: str, **lora):
    import peft

    return trained(peft.get_peft_model(tiny_llama(dtype=dtype), peft.LoraConfig(r=4, lora_alpha=8, **lora)))


def _save(model, root):
    from stagerd import Stager

    with Stager(root) as stager:
        stager.save(model.state_dict(), 1, model=model).result()
    step = root / layout.step_dir_name(1)
    return step, commit_marker.read_marker(step).hub_plan


TOKENS = "trainable tokens of a tied weight whose tied layer does not share them"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_tied_modules_to_save_copy_merges_as_merge_and_unload(dtype, tmp_path):
    model = _build(
        dtype, target_modules=["q_proj"], modules_to_save=["embed_tokens"], ensure_weight_tying=True
    )
    step, plan = _save(model, tmp_path / "root")
    assert plan is not None and plan.origin == "peft"  # merged, not the fallback to PEFT's own names
    merged = copy.deepcopy(model).merge_and_unload()
    assert merged.lm_head.weight is merged.get_input_embeddings().weight  # still tied: written once
    merged.save_pretrained(tmp_path / "ref")
    out = tmp_path / "out"
    out.mkdir()
    build_export(
        open_source(step), out, dtype=None, keep_dtype=None, reference=None, max_shard_size=1 << 40,
        threads=1, progress=None,
    )  # fmt: skip
    harness.assert_same_tensors(out, tmp_path / "ref")
    harness.assert_same_weight_files(out, tmp_path / "ref")
    assert (out / "config.json").read_bytes() == (tmp_path / "ref" / "config.json").read_bytes()


@pytest.mark.parametrize(
    ("lora", "words"),
    [
        ({"target_modules": ["q_proj", "embed_tokens"]}, "LoRA on a tied weight"),
        ({"target_modules": ["q_proj", "lm_head"]}, "LoRA on a tied weight"),
        (
            {"target_modules": ["q_proj", "embed_tokens"], "ensure_weight_tying": True},
            "LoRA on a tied weight",
        ),
        (
            {
                "target_modules": ["q_proj"],
                "trainable_token_indices": {"embed_tokens": [1, 5], "lm_head": [2, 5]},
            },
            TOKENS,
        ),
        ({"target_modules": ["q_proj"], "trainable_token_indices": {"lm_head": [2, 5]}}, TOKENS),
    ],
)
def test_what_merge_and_unload_would_change_keeps_peft_names_with_a_warning(lora, words, tmp_path, caplog):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PEFT's own warning about tied layers in the adapter
        model = _build("float32", **lora)
    _, plan = _save(model, tmp_path / "root")
    assert plan is None or plan.origin != "peft"
    assert any("keeps the PEFT model's own names" in r.message and words in r.message for r in caplog.records)
