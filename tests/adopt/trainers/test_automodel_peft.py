"""`stagerd watch --adopt` on what NeMo AutoModel 0.7 writes when it trains LoRA adapters (`peft:` in its
recipe; driven in-process on 2 gloo CPU ranks, see automodel_peft_run.py): `epoch_0_step_2/model/` holds
the adapter alone as PEFT names it, finished when `.incomplete` is gone. It is published as
`PeftModel.save_pretrained` writes it, and `PeftModel.from_pretrained(base, DIR)` loads the trained
factors into the base model."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.adopt.helpers import published, tree_digest, watch_once
from tests.adopt.trainers import automodel_peft_run, tiny
from tests.daemon_helpers import free_port
from tests.gloo import launch

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("automodel_peft")
    launch(automodel_peft_run.train, str(tmp / "train"), str(tmp / "ref"), free_port(), deadline_s=240)
    return tmp


def test_the_adapter_is_published_as_peft_saves_it_and_loads_into_the_base(run, tmp_path):
    import torch
    import transformers as tf
    from peft import PeftModel
    from safetensors.torch import load_file

    ckpt = run / "train" / f"epoch_0_step_{tiny.STEPS}"
    assert (ckpt / "model" / "adapter_model.safetensors").is_file() and not (
        ckpt / "model" / ".hf_metadata"
    ).exists()
    cut = ckpt.with_name(f"epoch_0_step_{2 * tiny.STEPS}")  # killed before it removed `.incomplete`
    shutil.copytree(ckpt, cut)
    (cut / ".incomplete").touch()
    before = tree_digest(run / "train")

    res = watch_once(run / "train", tmp_path / "sink")
    out = res.stdout + res.stderr
    assert "1 step(s) published, 0 not" in out, out
    assert not published(tmp_path / "sink", 2 * tiny.STEPS).exists()
    export = published(tmp_path / "sink", tiny.STEPS)
    names = sorted(p.name for p in export.iterdir())
    assert names == ["adapter_config.json", "adapter_model.safetensors", "stagerd.manifest.json"]
    config = (export / "adapter_config.json").read_text()
    assert json.loads(config) == json.loads((ckpt / "model" / "adapter_config.json").read_text())
    assert tree_digest(run / "train") == before

    base = tf.AutoModelForCausalLM.from_pretrained(run / "ref" / "base")
    loaded = PeftModel.from_pretrained(base, export).state_dict()
    trained = load_file(run / "ref" / "lora.safetensors")
    assert trained
    for name, value in trained.items():
        peft_name = "base_model.model." + name.replace(".weight", ".default.weight")
        assert torch.equal(loaded[peft_name], value), name
