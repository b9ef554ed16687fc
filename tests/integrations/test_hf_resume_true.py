"""`StagerdCallback` in one process, as a script that already resumes with the Trainer's own
`train(resume_from_checkpoint=True)`: True finds the newest step committed under ROOT (the Trainer alone
looks for `checkpoint-*` under output_dir, where nothing is written, and raises), and the run goes on as
the uninterrupted one would, bit for bit, with gradient accumulation, a warmup-cosine schedule, dropout,
and the save in the middle of an epoch."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from stagerd.contract import layout
from tests.integrations.hf_ranks import dataset, model, tokenizer

pytestmark = pytest.mark.slow
STEPS, EVERY = 6, 2  # 16 samples, 2 per batch, 2 batches a step: 4 steps an epoch, a save mid-epoch


def _trainer(out: Path, root: Path, seed: int) -> Any:
    import transformers as tf

    from stagerd.integrations.transformers import StagerdCallback

    args = tf.TrainingArguments(
        output_dir=str(out), max_steps=STEPS, save_strategy="steps", save_steps=EVERY, logging_steps=1,
        per_device_train_batch_size=2, gradient_accumulation_steps=2, learning_rate=1e-2,
        lr_scheduler_type="cosine", warmup_steps=2, use_cpu=True, report_to=[], disable_tqdm=True, seed=7,
    )  # fmt: skip
    m = model(seed)
    m.config.attention_dropout = 0.1
    tok = tokenizer()
    collator = tf.DataCollatorForLanguageModeling(tok, mlm=False)
    return tf.Trainer(model=m, args=args, train_dataset=dataset(), processing_class=tok,
                      data_collator=collator, callbacks=[StagerdCallback(root=root)])  # fmt: skip


def _losses(trainer: Any) -> dict[int, float]:
    return {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}


def test_resume_from_checkpoint_true_goes_on_from_the_newest_staged_step(tmp_path):
    full = _trainer(tmp_path / "out", tmp_path / "full", seed=0)
    full.train()
    name = layout.step_dir_name(EVERY)
    shutil.copytree(tmp_path / "full" / name, tmp_path / "resumed" / name)  # as a preempted run leaves it

    resumed = _trainer(tmp_path / "out", tmp_path / "resumed", seed=1)
    resumed.train(resume_from_checkpoint=True)

    assert sorted(_losses(resumed)) == list(range(1, STEPS + 1))  # steps 1-2 from the step's trainer_state
    assert _losses(resumed) == _losses(full)
    assert resumed.state.epoch == full.state.epoch == 1.5
    a, b = full.model.state_dict(), resumed.model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not list((tmp_path / "out").glob("checkpoint-*"))


def test_with_nothing_staged_true_is_the_trainers_own_resume(tmp_path):
    """No step under ROOT: True goes on to the Trainer, which looks in output_dir and says so."""
    trainer = _trainer(tmp_path / "out", tmp_path / "root", seed=0)
    with pytest.raises(ValueError, match="No valid checkpoint found in output directory"):
        trainer.train(True)
