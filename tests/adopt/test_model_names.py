"""Which plan an adopted DCP checkpoint gets from its config.json (`daemon/hf_names.py`): the model's own
save names where the selected tensors are all of the model config.json names, the selection's otherwise.
Each checkpoint is a real `dcp.save` of a tiny transformers model's state dict, in one process."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest

from stagerd.daemon.hf_names import KEPT, model_plan
from stagerd.engine.adopt.export import export_adopted
from stagerd.engine.adopt.source import AdoptOptions, open_adopted
from tests.fidelity import models
from tests.fidelity.harness import assert_same_tensors, assert_same_weight_files

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
SHARD = 20_000  # bytes: several files of the tiny model


def _saved(tmp: Path, kind: str, *, drop: tuple[str, ...] = ()) -> Path:
    """ROOT/step-1: `dcp.save({"model": state dict})` (less `drop`) of a tiny `kind`, its config.json
    beside it; tmp/ref: the model's save_pretrained."""
    import torch
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(0)
    model = models.build(kind)
    sd = {k: v for k, v in model.state_dict().items() if k not in drop}
    ckpt = tmp / "root" / "step-1"
    dcp.save({"model": sd}, checkpoint_id=str(ckpt), no_dist=True)
    model.config.save_pretrained(ckpt)
    model.save_pretrained(tmp / "ref")
    return ckpt


def test_a_moe_checkpoint_is_exported_under_save_pretrained_names(tmp_path):
    ckpt = _saved(tmp_path, "qwen3_moe")
    source = open_adopted(ckpt, AdoptOptions(model_plan=model_plan))
    assert source.plan.origin == "transformers"
    assert "model.model.layers.0.mlp.experts.gate_up_proj" in source.keys  # the fused live tensor, split
    export_adopted(ckpt, tmp_path / "work", AdoptOptions(model_plan=model_plan))
    assert_same_tensors(tmp_path / "work" / "export", tmp_path / "ref")
    assert_same_weight_files(tmp_path / "work" / "export", tmp_path / "ref")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_sharded_and_cast_the_files_and_index_are_save_pretrained_s(tmp_path, dtype):
    """Cut into several files, and cast, as `model.to(dtype).save_pretrained(max_shard_size=...)`: the
    experts' split views of one fused tensor stay together, and the index's sizes are the model's."""
    import torch
    import transformers as tf

    ckpt = _saved(tmp_path, "qwen3_moe")
    ref = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "ref").to(getattr(torch, dtype))
    ref.save_pretrained(tmp_path / "ref_sharded", max_shard_size=SHARD)
    assert len(list((tmp_path / "ref_sharded").glob("*.safetensors"))) > 2
    cast = None if dtype == "float32" else "bf16"
    export_adopted(
        ckpt, tmp_path / "work", AdoptOptions(model_plan=model_plan), dtype=cast, max_shard_size=SHARD
    )
    assert_same_weight_files(tmp_path / "work" / "export", tmp_path / "ref_sharded")


def test_a_tied_head_the_trainer_left_out_is_read_from_its_twin(tmp_path):
    ckpt = _saved(tmp_path, "qwen3_moe_tied", drop=("lm_head.weight",))  # as AutoModel saves a tied model
    source = open_adopted(ckpt, AdoptOptions(model_plan=model_plan))
    assert source.plan.origin == "transformers"
    export_adopted(ckpt, tmp_path / "work", AdoptOptions(model_plan=model_plan))
    assert_same_tensors(tmp_path / "work" / "export", tmp_path / "ref")
    assert_same_weight_files(tmp_path / "work" / "export", tmp_path / "ref")


def test_a_selection_that_holds_the_model_under_a_prefix_keeps_its_names(tmp_path, caplog):
    """`--adopt-select '(.+)'` keeps `model.` on every name: the model is found under that prefix, and
    its export under its own names would not be what the operator selected."""
    ckpt = _saved(tmp_path, "qwen3_moe")
    options = AdoptOptions(select="(.+)", model_plan=model_plan)
    with caplog.at_level(logging.WARNING, logger="stagerd"):
        source = open_adopted(ckpt, options)
    assert KEPT in caplog.text and "under 'model.'" in caplog.text
    assert source.plan.origin == "mapping"
    assert {v.name for v in source.plan.views} == {v.source for v in source.plan.views}


def test_without_a_config_or_with_a_mapping_the_names_are_the_selections(tmp_path):
    ckpt = _saved(tmp_path, "qwen3_moe")
    mapping = tmp_path / "mapping.json"
    mapping.write_text(json.dumps({"rules": [{"match": r"(.+)", "name": r"\1"}]}))
    assert open_adopted(ckpt, AdoptOptions(mapping=mapping, model_plan=model_plan)).plan.origin == "mapping"
    (ckpt / "config.json").unlink()
    assert open_adopted(ckpt, AdoptOptions(model_plan=model_plan)).plan.origin == "mapping"


def test_a_checkpoint_of_save_pretrained_s_names_is_kept_as_it_is_and_not_warned_of(tmp_path, caplog):
    """A trainer that saves the Hub's names itself (AutoModel's own MoE models) needs no conversion."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    ckpt = _saved(tmp_path, "qwen3_moe")
    hubs = tmp_path / "hubs" / "step-1"
    dcp.save(
        {"model": load_file(tmp_path / "ref" / "model.safetensors")}, checkpoint_id=str(hubs), no_dist=True
    )
    shutil.copy(ckpt / "config.json", hubs)
    with caplog.at_level(logging.INFO, logger="stagerd"):
        assert open_adopted(hubs, AdoptOptions(model_plan=model_plan)).plan.origin == "mapping"
    assert KEPT not in caplog.text, caplog.text
    export_adopted(hubs, tmp_path / "work", AdoptOptions(model_plan=model_plan))
    assert_same_tensors(tmp_path / "work" / "export", tmp_path / "ref")
