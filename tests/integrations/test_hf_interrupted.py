"""A training interrupted in the same process (Ctrl-C in a notebook: `KeyboardInterrupt` out of
`trainer.train()`) right after a save, then resumed with `train(resume_from_checkpoint=True)`, on the
same Trainer or on a new one with a callback of its own under the same ROOT (the notebook's cell run
again): the save that was still being written when the training stopped is the step it resumes from,
and the run goes on as the uninterrupted one, bit for bit."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from stagerd.contract import layout
from tests.integrations.hf_ranks import dataset, model, tokenizer

pytestmark = pytest.mark.slow
STEPS, EVERY = 4, 2


def _trainer(out: Path, root: Path, more: list[Any]) -> Any:
    import transformers as tf

    from stagerd.integrations.transformers import StagerdCallback

    args = tf.TrainingArguments(
        output_dir=str(out), max_steps=STEPS, save_steps=EVERY, logging_steps=1,
        per_device_train_batch_size=2, learning_rate=1e-2, use_cpu=True, report_to=[], disable_tqdm=True,
        seed=7,
    )  # fmt: skip
    tok = tokenizer()
    return tf.Trainer(model=model(0), args=args, train_dataset=dataset(), processing_class=tok,
                      data_collator=tf.DataCollatorForLanguageModeling(tok, mlm=False),
                      callbacks=[StagerdCallback(root=root), *more])  # fmt: skip


def _losses(trainer: Any) -> dict[int, float]:
    return {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}


class _Interrupt:
    """Ctrl-C as the first save returns: its copy taken, its write and commit still to come."""

    def __init__(self) -> None:
        self.armed = True

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.armed:
            self.armed = False
            raise KeyboardInterrupt


@pytest.mark.parametrize("again", ["same Trainer", "new Trainer"])
def test_a_run_interrupted_after_a_save_resumes_from_that_save(tmp_path, again):
    from transformers import TrainerCallback

    uninterrupted = _trainer(tmp_path / "out", tmp_path / "full", [])
    uninterrupted.train()

    interrupt = type("Interrupt", (_Interrupt, TrainerCallback), {})()
    trainer = _trainer(tmp_path / "out", tmp_path / "root", [interrupt])
    new = _trainer(tmp_path / "out", tmp_path / "root", [])  # made before: it resumes right after the stop
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    assert trainer.state.global_step == EVERY
    if again == "new Trainer":
        trainer = new
    trainer.train(resume_from_checkpoint=True)  # the step being written when it stopped: not None

    assert _losses(trainer) == _losses(uninterrupted)
    assert sorted(_losses(trainer)) == list(range(1, STEPS + 1))
    want, got = uninterrupted.model.state_dict(), trainer.model.state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert sorted(p.name for p in (tmp_path / "root").glob("step-*")) == [
        layout.step_dir_name(s) for s in (EVERY, STEPS)
    ]
