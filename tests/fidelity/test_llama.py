"""Llama, tied and untied: the export is what `save_pretrained` writes, and loads to the same logits."""

from __future__ import annotations

import pytest

from stagerd.contract import commit_marker, layout
from tests.fidelity import harness

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("kind", ["llama", "llama_tied"])
def test_llama_is_what_save_pretrained_writes(kind, tmp_path):
    harness.check_all(harness.run(kind, tmp_path, model=True))


def test_tied_weights_of_a_model_not_from_transformers_are_each_written(tmp_path):
    """Without `model=` and without a transformers config.json the Stager knows no transformers model: the
    tied weights are staged once, and the export writes every key, each with its own bytes. (With the
    config alone, it finds the model: `tests/integrations/test_config_plan.py`.)"""
    run = harness.run("llama_tied", tmp_path, extras={"tokenizer.json": b"{}"})
    for mode in ("keep", "bf16"):
        got, want = harness.tensors(run.exports[mode]), harness.tensors(run.ref / mode)
        assert set(got) == {*want, "lm_head.weight"}
        assert got["lm_head.weight"] == want["model.embed_tokens.weight"]
        assert {k: got[k] for k in want} == want
    marker = commit_marker.read_marker(run.root / layout.step_dir_name(3))
    assert marker.tensors is not None and "lm_head.weight" not in marker.tensors  # staged once


def test_twelve_layers_in_one_file_are_the_bytes_save_pretrained_writes(tmp_path):
    """The file itself, not only its tensors: 12 layers (`layers.10` sorts before `layers.2` in
    safetensors' order), tied, cast to bf16. Before: the same tensors in another order."""
    import torch
    import transformers as tf

    from stagerd import Stager
    from stagerd.engine.export import build_export
    from stagerd.engine.source import open_source

    cfg = tf.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=12, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(cfg)
    with Stager(tmp_path / "root", checkpointer="thread") as stager:
        stager.save(model.state_dict(), step=1, model=model, extras={"config.json": cfg.to_dict()})
        stager.wait()
    for dtype in ("BF16",):  # kept: test_consolidate.py::test_one_file_is_the_bytes_safetensors_writes
        out, ref = tmp_path / f"out-{dtype}", tmp_path / f"ref-{dtype}"
        out.mkdir()
        build_export(
            open_source(tmp_path / "root" / layout.step_dir_name(1)), out, dtype=dtype, keep_dtype=None,
            reference=None, max_shard_size=1 << 40, threads=1, progress=None,
        )  # fmt: skip
        (model if dtype is None else model.to(torch.bfloat16)).save_pretrained(ref)
        harness.assert_same_weight_files(out, ref)
