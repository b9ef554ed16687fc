"""`StagerdCallback` in one process, as a script that resumes with the Trainer's own
`train(resume_from_checkpoint=...)` rather than `resume()`: True and ROOT find the newest step committed
under ROOT, and a step directory ROOT/step-N (what `best_model_checkpoint` names) that step (the Trainer
alone looks for `checkpoint-*` under output_dir, where nothing is written, or for its own files in the
step directory, and raises). The run goes on as the uninterrupted one would, bit for bit, with gradient
accumulation, a warmup-cosine schedule, dropout, and the save in the middle of an epoch."""

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


@pytest.fixture(scope="module")
def full(tmp_path_factory) -> tuple[Path, Any]:
    tmp = tmp_path_factory.mktemp("full")
    trainer = _trainer(tmp / "out", tmp / "root", seed=0)
    trainer.train()
    return tmp / "root", trainer


@pytest.mark.parametrize("given", ["True", "ROOT", "ROOT/step-N"])
def test_the_trainers_resume_argument_goes_on_from_the_staged_step(full, tmp_path, given):
    full_root, uninterrupted = full
    name = layout.step_dir_name(EVERY)
    root = tmp_path / "root"
    shutil.copytree(full_root / name, root / name)  # as a preempted run leaves it
    checkpoint = {"True": True, "ROOT": str(root), "ROOT/step-N": str(root / name)}[given]

    resumed = _trainer(tmp_path / "out", root, seed=1)
    resumed.train(resume_from_checkpoint=checkpoint)

    assert sorted(_losses(resumed)) == list(range(1, STEPS + 1))  # steps 1-2 from the step's trainer_state
    assert _losses(resumed) == _losses(uninterrupted)
    assert resumed.state.epoch == uninterrupted.state.epoch == 1.5
    a, b = uninterrupted.model.state_dict(), resumed.model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not list((tmp_path / "out").glob("checkpoint-*"))


def test_with_nothing_staged_true_is_the_trainers_own_resume(tmp_path):
    """No step under ROOT: True goes on to the Trainer, which looks in output_dir and says so."""
    trainer = _trainer(tmp_path / "out", tmp_path / "root", seed=0)
    with pytest.raises(ValueError, match="No valid checkpoint found in output directory"):
        trainer.train(True)
