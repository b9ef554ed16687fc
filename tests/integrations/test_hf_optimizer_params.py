"""A Trainer subclass whose optimizer also steps a parameter that is not the model's (a learnable loss
weight its `compute_loss` uses): a step's optimizer state is saved by parameter name, from the model
(`get_optimizer_state_dict`), and such a parameter has none. The first save is a `SaveInputError` that
says so, not a `KeyError` from inside torch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from stagerd.errors import SaveInputError
from tests.integrations.hf_ranks import dataset, model, tokenizer

pytestmark = pytest.mark.slow


def _trainer(out: Path, root: Path) -> Any:
    import transformers as tf

    from stagerd.integrations.transformers import StagerdCallback

    class WeightedLoss(tf.Trainer):
        def create_optimizer(self, model: Any = None) -> Any:
            self.weight = torch.nn.Parameter(torch.ones(()))
            self.optimizer = torch.optim.AdamW([*self.model.parameters(), self.weight], lr=1e-2)
            return self.optimizer

        def compute_loss(self, model: Any, inputs: Any, return_outputs: bool = False, **kwargs: Any) -> Any:
            out = model(**inputs)
            return (out.loss * self.weight, out) if return_outputs else out.loss * self.weight

    args = tf.TrainingArguments(
        output_dir=str(out), max_steps=2, save_steps=1, per_device_train_batch_size=2, use_cpu=True,
        report_to=[], disable_tqdm=True, seed=7,
    )  # fmt: skip
    tok = tokenizer()
    collator = tf.DataCollatorForLanguageModeling(tok, mlm=False)
    return WeightedLoss(model=model(0), args=args, train_dataset=dataset(), processing_class=tok,
                        data_collator=collator, callbacks=[StagerdCallback(root=root)])  # fmt: skip


def test_an_optimizer_stepping_a_parameter_outside_the_model_is_refused_by_name(tmp_path):
    trainer = _trainer(tmp_path / "out", tmp_path / "root")
    with pytest.raises(SaveInputError, match="1 parameter") as e:
        trainer.train()
    assert "not the model's" in e.value.message
    assert not list((tmp_path / "root").glob("step-*"))
