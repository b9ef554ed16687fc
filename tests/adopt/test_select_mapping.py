"""`--adopt-step`, `--adopt-select` and `--mapping` on what a user's own loop writes with `dcp.save`: a
directory name no preset knows, the model beside an EMA copy, and the model's own names under a wrapper's
prefix. The EMA copy is published, named as its `save_pretrained` names it, byte for byte."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.adopt.helpers import published, watch_once
from tests.fidelity import models
from tests.fidelity.harness import assert_same_tensors

STEP = 7


def _save(root: Path) -> Any:
    """`ROOT/run_7_done/`: `{"model": ..., "ema": ...}` of a wrapper holding the HF model as `backbone`,
    with config.json beside it; returns the EMA model."""
    import torch
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(0)
    net, ema = models.build("llama"), models.build("llama")
    wrapped = {f"backbone.{k}": v for k, v in ema.state_dict().items()}
    state = {"model": {f"backbone.{k}": v for k, v in net.state_dict().items()}, "ema": wrapped}
    dcp.save(state, checkpoint_id=str(root / f"run_{STEP}_done"), no_dist=True)
    ema.config.save_pretrained(root)
    return ema


def test_a_named_step_an_ema_selection_and_a_mapping_publish_the_ema_model(tmp_path):
    root = tmp_path / "root"
    ema = _save(root)
    ema.save_pretrained(tmp_path / "ref")
    mapping = tmp_path / "mapping.json"
    mapping.write_text(json.dumps({"strict": True, "rules": [{"match": r"backbone\.(.+)", "name": r"\1"}]}))

    flags = ["--adopt-step", r"run_(?P<step>\d+)_done", "--mapping", str(mapping)]
    # the group `name` names the tensor, though another group comes first
    res = watch_once(root, tmp_path / "sink", *flags, "--adopt-select", r"(ema)\.(?P<name>.+)")
    assert "1 step(s) published, 0 not" in res.stdout + res.stderr, res.stdout + res.stderr
    assert_same_tensors(published(tmp_path / "sink", STEP), tmp_path / "ref")


def test_without_the_step_regex_the_directory_is_not_a_step(tmp_path):
    root = tmp_path / "root"
    _save(root)
    res = watch_once(root, tmp_path / "sink", "--adopt-select", r"ema\.(.+)")
    assert res.returncode == 0 and "0 step(s) published" in res.stdout + res.stderr, res.stdout + res.stderr


def test_an_adapter_alone_under_a_models_preset_is_named_as_one():
    from stagerd.contract.adopt.presets import PRESETS, resolve_selection
    from stagerd.errors import AdoptError

    name = "model.base_model.model.model.layers.0.self_attn.q_proj.lora_{}.weight"
    shapes = {name.format("A"): (2, 8), name.format("B"): (8, 2)}
    with pytest.raises(AdoptError, match="a PEFT adapter alone") as e:
        resolve_selection(PRESETS["dcp"], shapes)
    assert "--adopt hf-trainer" in (e.value.hint or "")
