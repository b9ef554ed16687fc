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
    """An op registered for a model that is not a permutation of whole lines (here: a flip of the rows)."""
    from transformers.core_model_loading import ConversionOps, WeightConverter

    from tests.fidelity import models

    class Flip(ConversionOps):
        def convert(self, input_dict, source_patterns, target_patterns, **kwargs):
            (tensor,) = (v[0] if isinstance(v, list) else v for v in input_dict.values())
            return {target_patterns[0]: tensor.flip(0)}

        @property
        def reverse_op(self):
            return Flip()

    model = models.build("llama")
    model._weight_conversions = [
        WeightConverter("mlp.down_flipped", "mlp.down_proj.weight", operations=[Flip()])
    ]
    _refused(tmp_path, model.state_dict(), "uses 'flip'.*cannot be planned", model=model)


def test_model_and_mapping_together_are_refused(tmp_path):
    _refused(tmp_path, {"a": torch.ones(2)}, "not both", model=torch.nn.Linear(2, 2), mapping=FUSED)
