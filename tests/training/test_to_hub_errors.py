"""Bad to-Hub plans are named errors raised by `Stager.save` itself, before anything is written: nothing is
committed, so nothing is exported or published (one process, no gloo: the checks are the same)."""

from __future__ import annotations

import pytest
import torch

from stagerd import Stager
from stagerd.contract import layout
from stagerd.errors import HubPlanError

FUSED = {
    "rules": [{"match": "qkv", "split_dim": 0, "split": [{"name": "q", "size": 4}, {"name": "k", "size": 3}]}]
}


def _refused(tmp_path, sd, words, **kwargs):
    with Stager(tmp_path / "root", checkpointer="thread") as stager, pytest.raises(HubPlanError, match=words):
        stager.save(sd, step=1, **kwargs)
    assert not layout.is_committed(tmp_path / "root" / layout.step_dir_name(1))
    assert not (tmp_path / "root" / layout.step_dir_name(1) / layout.MODEL_DIR).exists()


@pytest.mark.parametrize(
    ("mapping", "words"),
    [
        (FUSED, "add up to 7, not its dim 0 of 8"),
        ({"rules": [{"match": "qkv|norm", "name": "x"}]}, "two tensors are named 'x'"),
        (
            {"strict": True, "rules": [{"match": "qkv", "name": "x"}]},
            r"leaves 1 saved tensors unmapped: \['norm'\]",
        ),
        ({"rules": [{"match": "qkv", "nme": "x"}]}, "rule 0 is malformed"),
    ],
)
def test_a_bad_mapping_is_refused_at_save_time(tmp_path, mapping, words):
    sd = {"qkv": torch.ones(8, 2), "norm": torch.ones(2)}
    _refused(tmp_path, sd, words, mapping=mapping)


def test_a_conversion_that_is_not_a_box_is_refused_at_save_time(tmp_path):
    """A checkpoint that stores a weight transposed (as some registry entries do): saving it back is a
    permutation of single elements, which the engine does not move at copy speed, so it is refused."""
    from transformers.core_model_loading import Transpose, WeightConverter

    from tests.fidelity import models

    model = models.build("llama")
    model._weight_conversions = [
        WeightConverter("mlp.down_weight_t", "mlp.down_proj.weight", operations=[Transpose(0, 1)])
    ]
    _refused(tmp_path, model.state_dict(), "reorders the elements.*cannot be planned", model=model)


def test_model_and_mapping_together_are_refused(tmp_path):
    _refused(tmp_path, {"a": torch.ones(2)}, "not both", model=torch.nn.Linear(2, 2), mapping=FUSED)
