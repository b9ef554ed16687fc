"""`StagerdCallback` in one process, as a script that resumes with the Trainer's own
`train(resume_from_checkpoint=...)` rather than `resume()`: True and ROOT find the newest step committed
under ROOT, and a step directory ROOT/step-N (what `best_model_checkpoint` names) that step (the Trainer
alone looks for `checkpoint-*` under output_dir, where nothing is written, or for its own files in the
step directory, and raises). The run goes on as the uninterrupted one would, bit for bit, with gradient
accumulation, a warmup-cosine schedule, dropout, and the save in the middle of an epoch.

The callback given in `callbacks=[...]` and one added later with `trainer.add_callback(...)` behave alike;
a callback removed with `remove_callback` or `pop_callback` leaves the Trainer's own saves and resumes."""

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
HOW = ["callbacks", "add_callback"]


def _trainer(out: Path, root: Path, seed: int, how: str = "callbacks") -> Any:
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
    given = [StagerdCallback(root=root)] if how == "callbacks" else None
    trainer = tf.Trainer(model=m, args=args, train_dataset=dataset(), processing_class=tok,
                         data_collator=collator, callbacks=given)  # fmt: skip
    if how == "add_callback":
        trainer.add_callback(StagerdCallback(root=root))
    return trainer


def _losses(trainer: Any) -> dict[int, float]:
    return {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}


def _same_run(resumed: Any, uninterrupted: Any) -> None:
    assert sorted(_losses(resumed)) == list(range(1, STEPS + 1))  # the first steps from trainer_state
    assert _losses(resumed) == _losses(uninterrupted)
    assert resumed.state.epoch == uninterrupted.state.epoch == 1.5
    a, b = uninterrupted.model.state_dict(), resumed.model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def full(tmp_path_factory) -> tuple[Path, Any]:
    tmp = tmp_path_factory.mktemp("full")
    trainer = _trainer(tmp / "out", tmp / "root", seed=0)
    trainer.train()
    return tmp / "root", trainer


@pytest.fixture(scope="module", params=["remove_callback", "pop_callback"])
def plain(request, tmp_path_factory) -> tuple[Path, Any]:
    """A run whose callback, given in `callbacks=[...]`, is removed before it trains: the Trainer saves."""
    from stagerd.integrations.transformers import StagerdCallback

    tmp = tmp_path_factory.mktemp("plain")
    trainer = _trainer(tmp / "out", tmp / "root", seed=0)
    getattr(trainer, request.param)(StagerdCallback)
    trainer.train()
    return tmp / "out", trainer


@pytest.mark.parametrize("how", HOW)
@pytest.mark.parametrize("given", ["True", "ROOT", "ROOT/step-N"])
def test_the_trainers_resume_argument_goes_on_from_the_staged_step(full, tmp_path, given, how):
    full_root, uninterrupted = full
    name = layout.step_dir_name(EVERY)
    root = tmp_path / "root"
    shutil.copytree(full_root / name, root / name)  # as a preempted run leaves it
    checkpoint = {"True": True, "ROOT": str(root), "ROOT/step-N": str(root / name)}[given]

    resumed = _trainer(tmp_path / "out", root, seed=1, how=how)
    resumed.train(resume_from_checkpoint=checkpoint)

    _same_run(resumed, uninterrupted)
    assert not list((tmp_path / "out").glob("checkpoint-*"))
    assert layout.step_dir_name(STEPS) in [p.name for p in root.iterdir()]


@pytest.mark.parametrize("how", HOW)
def test_with_nothing_staged_true_is_the_trainers_own_resume(tmp_path, how):
    """No step under ROOT: True goes on to the Trainer, which looks in output_dir and says so."""
    trainer = _trainer(tmp_path / "out", tmp_path / "root", seed=0, how=how)
    with pytest.raises(ValueError, match="No valid checkpoint found in output directory"):
        trainer.train(True)


def test_with_nothing_staged_root_is_a_load_error_naming_it(tmp_path):
    """ROOT given with no committed step under it, or a step ROOT lacks: stagerd's LoadError naming ROOT
    and what it holds, not the Trainer's "Can't find a valid checkpoint", which says nothing of stagerd."""
    from stagerd.errors import LoadError
    from stagerd.integrations.transformers import StagerdCallback

    root = tmp_path / "root"
    root.mkdir()
    trainer = _trainer(tmp_path / "out", root, seed=0)
    with pytest.raises(LoadError, match="no committed step under ROOT on any rank: it is empty") as e:
        trainer.train(resume_from_checkpoint=str(root))
    assert e.value.path == str(root)
    callback = next(c for c in trainer.callback_handler.callbacks if isinstance(c, StagerdCallback))
    with pytest.raises(LoadError, match=f"{root}: step 5 is not committed under ROOT on any rank: it is"):
        callback.resume(trainer, step=5)


@pytest.mark.parametrize("how", HOW)
def test_with_nothing_staged_true_resumes_from_the_trainers_own_checkpoint(full, plain, tmp_path, how):
    """An output_dir holding the Trainer's own `checkpoint-*` and an empty ROOT: True resumes from the
    newest checkpoint, and the callback saves the later steps under ROOT."""
    out, _ = plain
    mine = f"checkpoint-{EVERY}"
    shutil.copytree(out / mine, tmp_path / "out" / mine)

    resumed = _trainer(tmp_path / "out", tmp_path / "root", seed=1, how=how)
    resumed.train(resume_from_checkpoint=True)

    _same_run(resumed, full[1])
    assert [p.name for p in (tmp_path / "out").iterdir()] == [mine]  # nothing new under output_dir
    assert layout.step_dir_name(STEPS) in [p.name for p in (tmp_path / "root").iterdir()]


def test_a_removed_callback_leaves_the_trainers_own_saves_and_resumes(full, plain, tmp_path):
    out, trainer = plain
    _same_run(trainer, full[1])
    assert sorted(p.name for p in out.glob("checkpoint-*")) == [f"checkpoint-{s}" for s in (2, 4, 6)]
    assert not (out.parent / "root").exists()
    assert not {"train", "_save_checkpoint", "_load_optimizer_and_scheduler"} & set(trainer.__dict__)
    # a ROOT holding step 2 and output_dir the Trainer's checkpoint-4: True is the Trainer's, step 4
    name = layout.step_dir_name(EVERY)
    shutil.copytree(full[0] / name, tmp_path / "root" / name)
    shutil.copytree(out / "checkpoint-4", tmp_path / "out" / "checkpoint-4")
    from stagerd.integrations.transformers import StagerdCallback

    resumed = _trainer(tmp_path / "out", tmp_path / "root", seed=1, how="add_callback")
    assert resumed.pop_callback(StagerdCallback) is not None
    resumed.train(resume_from_checkpoint=True)
    _same_run(resumed, full[1])
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["checkpoint-4", "checkpoint-6"]
    assert [p.name for p in (tmp_path / "root").iterdir()] == [name]
