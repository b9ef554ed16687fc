"""Without `model=`, a head model described only by its config (built from a config: no `architectures`)
exports as `save_pretrained` writes it. Its keys hold its base model's under `model.`: before, the bare
model that transformers maps the type to first was taken under that prefix, so the head was left out
(Llava's `lm_head.weight`) or every key kept the base model's names (Qwen2-VL, ViTMAE)."""

from __future__ import annotations

import json

import pytest

from stagerd import Stager
from stagerd.contract import layout
from stagerd.engine.export import export_step
from tests.fidelity import harness
from tests.fidelity.registry.cases import Case
from tests.fidelity.registry.check import build

CASES = [
    Case("llava", "LlavaForConditionalGeneration"),
    Case("qwen2_vl", "Qwen2VLForConditionalGeneration"),
    Case("vit_mae", "ViTMAEForPreTraining"),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_the_config_of_a_head_model_exports_its_head(tmp_path, case):
    model = build(case)
    config = json.loads(model.config.to_json_string())
    assert not config.get("architectures")
    with Stager(tmp_path / "root", checkpointer="thread") as stager:
        stager.save(model.state_dict(), step=1, extras={"config.json": config})
        stager.wait()
    export = export_step(tmp_path / "root" / layout.step_dir_name(1), threads=1).export_dir
    model.save_pretrained(tmp_path / "ref")
    harness.assert_same_tensors(export, tmp_path / "ref")
    harness.assert_same_weight_files(export, tmp_path / "ref")
