"""Llama, tied and untied: the export is what `save_pretrained` writes, and loads to the same logits."""

from __future__ import annotations

import pytest

from stagerd.contract import layout
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
    marker = layout.read_marker(run.root / layout.step_dir_name(3))
    assert marker.tensors is not None and "lm_head.weight" not in marker.tensors  # staged once
