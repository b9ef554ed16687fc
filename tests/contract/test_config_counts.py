"""A config.json whose model has more layers (or experts) than the adopted checkpoint could hold is refused
before the daemon's planners build that model on the meta device: a million layers took them an hour and
tens of GB, holding the planning lock. Checked on a real torchtitan-named `dcp.save` (the adopt fuzz's
seed), planned by the daemon's own `model_plan`."""

from __future__ import annotations

import json
import shutil
from typing import Any

import pytest

from stagerd.daemon.hf_names import model_plan
from stagerd.engine.adopt.config_shapes import refuse_oversized
from stagerd.engine.adopt.source import AdoptOptions, open_adopted
from stagerd.errors import ModelShapeError
from tests.contract.fuzz.adopt.seeds import CONFIG, TITAN_SHAPES, make_seeds

pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")


def _step(tmp_path, config: dict[str, Any]):
    seeds = make_seeds(tmp_path / "save")
    step = tmp_path / "step-5"
    shutil.copytree(seeds.save, step)
    (step / "config.json").write_text(json.dumps(config))
    return step


def test_a_config_of_more_layers_than_the_checkpoint_has_tensors_is_refused_unbuilt(tmp_path):
    """Before: 300 layers were built (a second each time the planners asked) and the export went on."""
    step = _step(tmp_path, {**CONFIG, "num_hidden_layers": 300})
    with pytest.raises(ModelShapeError, match=r"num_hidden_layers is 300, but the checkpoint holds 12 tens"):
        open_adopted(step, AdoptOptions("torchtitan", model_plan=model_plan))


@pytest.mark.parametrize(
    "config",
    [
        {"num_hidden_layers": 10**6},
        {"text_config": {"num_hidden_layers": 10**6}},
        {"num_experts": 10**9},
        {"text_config": {"vision_config": {"n_routed_experts": 17}}},
    ],
)
def test_counts_past_the_tensors_are_refused(config):
    with pytest.raises(ModelShapeError, match=r"config\.json describes another model"):
        refuse_oversized(config, TITAN_SHAPES)


@pytest.mark.parametrize(
    "config",
    [
        CONFIG,
        {"num_hidden_layers": 12, "num_experts": 16},  # experts grouped: one tensor's dimension each
        {"num_hidden_layers": True, "num_experts": "many", "text_config": [10**9]},  # not counts
    ],
)
def test_counts_the_tensors_can_hold_pass(config):
    refuse_oversized(config, TITAN_SHAPES)
