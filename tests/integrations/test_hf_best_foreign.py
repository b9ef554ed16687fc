"""`load_best_model_at_end` in a run that goes back over steps ROOT already holds: `trainer.train()` called
a second time on the same Trainer (each call trains from step 0), or a run rolled back to an older step
with another learning rate. Its saves of those steps are skipped (a committed step is never written
again), so when its best step is one of them, ROOT holds another run's weights there: loading them would
end the training with weights this run never had, under this run's best metric. It is a `LoadError` at
the end naming the step, as for a best step that is gone, never the other run's weights in silence."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from stagerd.contract import layout
from stagerd.errors import LoadError
from tests.integrations.hf_ranks import dataset, model, tokenizer

pytestmark = pytest.mark.slow
STEPS = 3


def _trainer(out: Path, root: Path, lr: float = 1e-2) -> Any:
    import transformers as tf

    from stagerd.integrations.transformers import StagerdCallback

    args = tf.TrainingArguments(
        output_dir=str(out), max_steps=STEPS, save_steps=1, eval_strategy="steps", eval_steps=1,
        load_best_model_at_end=True, metric_for_best_model="eval_loss", logging_steps=1,
        per_device_train_batch_size=2, learning_rate=lr, use_cpu=True, report_to=[], disable_tqdm=True,
        seed=7,
    )  # fmt: skip
    tok = tokenizer()
    collator = tf.DataCollatorForLanguageModeling(tok, mlm=False)
    evaluated = dataset().select([0, 1])
    return tf.Trainer(model=model(0), args=args, train_dataset=dataset(), eval_dataset=evaluated,
                      processing_class=tok, data_collator=collator,
                      callbacks=[StagerdCallback(root=root)])  # fmt: skip


def _weights(trainer: Any) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in trainer.model.state_dict().items()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a)


def test_a_second_train_whose_best_step_root_already_held_is_a_load_error(tmp_path):
    trainer = _trainer(tmp_path / "out", tmp_path / "root")
    trainer.train()
    first = _weights(trainer)
    assert trainer.state.best_global_step == STEPS  # the loss falls: the last step is the best

    best = layout.step_dir_name(STEPS)
    with pytest.raises(LoadError, match=f"step {STEPS}") as e:
        trainer.train()  # trains on from the first run's weights: its step 3 is not the first run's
    assert Path(e.value.path).name == best
    assert not _same(_weights(trainer), first)  # the last weights of this run, not the first run's step 3


def test_a_rolled_back_run_whose_best_step_root_already_held_is_a_load_error(tmp_path):
    _trainer(tmp_path / "out", tmp_path / "old").train()
    shutil.copytree(tmp_path / "old", tmp_path / "root")
    rolled_back = _trainer(tmp_path / "out", tmp_path / "root", lr=5e-3)
    with pytest.raises(LoadError, match=f"step {STEPS}"):
        rolled_back.train(resume_from_checkpoint=str(tmp_path / "root" / layout.step_dir_name(1)))
