"""`load_best_model_at_end` with `StagerdCallback` when the best step is not where the run saved it: gone
from ROOT before the end (as the daemon's `--keep-last` deletes a published step), or a run resumed under
a ROOT moved elsewhere. One process, a real Trainer, the tiny Llama of `hf_ranks`, 2 steps, an evaluation
and a save at each, the loss as the metric with `greater_is_better=True`: the loss falls, so step 1 is the
best. (Under DDP and FSDP2 on 2 ranks, against a plain Trainer run: `test_hf_trainer.py`.)"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from stagerd.contract import layout
from stagerd.errors import LoadError


def trainer(root: Path, out: Path, steps: int, callbacks: list[Any], limit: int | None = None) -> Any:
    import transformers as tf

    from stagerd.integrations.transformers import StagerdCallback
    from tests.integrations import hf_ranks

    args = tf.TrainingArguments(
        output_dir=str(out), max_steps=steps, eval_strategy="steps", save_steps=1, eval_steps=1,
        load_best_model_at_end=True, metric_for_best_model="loss", greater_is_better=True, use_cpu=True,
        report_to=[], disable_tqdm=True, per_device_train_batch_size=2, learning_rate=1e-2,
        save_total_limit=limit,
    )  # fmt: skip
    ds, collator = hf_ranks.dataset(), tf.DataCollatorForLanguageModeling(hf_ranks.tokenizer(), mlm=False)
    return tf.Trainer(model=hf_ranks.model(0), args=args, data_collator=collator, train_dataset=ds,
                      eval_dataset=ds.select(range(4)),
                      callbacks=[StagerdCallback(root=root), *callbacks])  # fmt: skip


def callback(t: Any) -> Any:
    from stagerd.integrations.transformers import StagerdCallback

    return next(c for c in t.callback_handler.callbacks if isinstance(c, StagerdCallback))


def weights(t: Any) -> dict[str, Any]:
    return {k: v.clone() for k, v in t.model.state_dict().items()}


@pytest.fixture(scope="module")
def first(tmp_path_factory):
    """Two steps under ROOT; the model ends with step 1's weights. `save_total_limit=1` with a best
    checkpoint: the Trainer deletes every other `checkpoint-*` under output_dir at the end, and none
    is this run's: another run's stays."""
    tmp = tmp_path_factory.mktemp("best")
    (tmp / "out" / "checkpoint-9").mkdir(parents=True)
    t = trainer(tmp / "root", tmp / "out", 2, [], limit=1)
    t.train()
    assert t.state.best_global_step == 1
    assert t.state.best_model_checkpoint == str((tmp / "root" / layout.step_dir_name(1)).absolute())
    assert [p.name for p in (tmp / "out").iterdir()] == ["checkpoint-9"]
    assert t.args.save_total_limit == 1  # the user's, back
    return tmp, weights(t)


def resumed_under(root: Path, first) -> Any:
    tmp, _ = first
    shutil.copytree(tmp / "root", root, ignore=shutil.ignore_patterns(".*"))
    t = trainer(root, root.parent / "out", 3, [])
    return t, callback(t).resume(t)


def test_a_run_resumed_under_a_moved_root_loads_the_best_step_from_there(tmp_path, first):
    t, checkpoint = resumed_under(tmp_path / "moved", first)
    t.train(resume_from_checkpoint=checkpoint)
    assert t.state.best_global_step == 1  # step 3 was evaluated, and was not better
    assert t.state.best_model_checkpoint == str(tmp_path / "moved" / layout.step_dir_name(1))
    final, best = weights(t), first[1]
    assert final.keys() == best.keys() and all(v.equal(best[k]) for k, v in final.items())


def test_a_best_step_gone_when_a_resumed_run_ends_is_a_load_error(tmp_path, first):
    t, checkpoint = resumed_under(tmp_path / "root", first)
    shutil.rmtree(tmp_path / "root" / layout.step_dir_name(1))
    with pytest.raises(LoadError, match=r"cannot load the best model \(loss=.*step 1 is not committed"):
        t.train(resume_from_checkpoint=checkpoint)  # the Trainer itself would have dropped it: last weights


def test_a_best_step_deleted_before_the_end_is_a_load_error_not_the_last_weights(tmp_path):
    """As the daemon's `--keep-last` would: the best step is gone when the training ends."""
    import transformers as tf

    class DeleteTheBest(tf.TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            if state.global_step == 2:
                stagerd.stager.wait()
                shutil.rmtree(root / layout.step_dir_name(state.best_global_step))

    root = tmp_path / "root"
    t = trainer(root, tmp_path / "out", 2, [DeleteTheBest()])
    stagerd = callback(t)
    with pytest.raises(LoadError, match=r"cannot load the best model \(loss=.*step 1 is not committed") as e:
        t.train()
    assert "delete by hand" in e.value.hint and "--step 1" in e.value.hint
    assert t.state.best_global_step == 1
    assert [s for s, _ in layout.committed_steps(root)] == [2]
    assert stagerd.stager is None  # closed: the Trainer ends without on_train_end
    assert not list((tmp_path / "out").glob("*"))


def test_the_best_step_is_pinned_against_retention_while_the_training_runs(tmp_path, caplog):
    """Pinned from its save until a better step is named or the training ends, so the daemon's
    `--keep-last` keeps it (`tests/daemon/test_step_pin.py`), and the run is not told to do without it."""
    import transformers as tf

    from stagerd.contract.step.pin import pinned

    root, seen = tmp_path / "root", []

    class Probe(tf.TrainerCallback):
        def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            seen.append((state.global_step, pinned(root, 1), pinned(root, 2)))

    with caplog.at_level("WARNING", logger="stagerd"):
        trainer(root, tmp_path / "out", 2, [Probe()]).train()
    assert seen == [(1, True, False), (2, True, False)]  # step 1 is the best throughout
    assert not pinned(root, 1)
    assert not [r.getMessage() for r in caplog.records if "keep-last" in r.getMessage()]
