"""What the callback refuses, before anything is trained or saved (one process, a real Trainer)."""

from __future__ import annotations

import pytest

from stagerd.errors import SaveInputError


def test_the_callbacks_own_arguments_are_refused():
    from stagerd.integrations.transformers import StagerdCallback

    with pytest.raises(SaveInputError, match=r"gives \['model'\] itself"):
        StagerdCallback(root="/nonexistent", model=object())


def test_a_best_step_deleted_before_the_end_is_a_load_error_not_the_last_weights(tmp_path):
    """As the daemon's `--keep-last` would: the best step (1, of 2) is gone when the training ends."""
    import shutil

    import transformers as tf

    from stagerd.contract import layout
    from stagerd.errors import LoadError
    from stagerd.integrations.transformers import StagerdCallback
    from tests.integrations import hf_ranks

    root = tmp_path / "root"
    stagerd = StagerdCallback(root=root)

    class DeleteTheBest(tf.TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            if state.global_step == 2:
                stagerd.stager.wait()
                shutil.rmtree(root / layout.step_dir_name(state.best_global_step))

    args = tf.TrainingArguments(
        output_dir=str(tmp_path / "out"), max_steps=2, eval_strategy="steps", save_steps=1, eval_steps=1,
        load_best_model_at_end=True, metric_for_best_model="loss", greater_is_better=True, use_cpu=True,
        report_to=[], disable_tqdm=True, per_device_train_batch_size=2, learning_rate=1e-2,
    )  # fmt: skip
    ds, collator = hf_ranks.dataset(), tf.DataCollatorForLanguageModeling(hf_ranks.tokenizer(), mlm=False)
    trainer = tf.Trainer(model=hf_ranks.model(0), args=args, data_collator=collator, train_dataset=ds,
                         eval_dataset=ds.select(range(4)), callbacks=[stagerd, DeleteTheBest()])  # fmt: skip
    with pytest.raises(LoadError, match=r"cannot load the best model \(loss=.*step 1 is not committed") as e:
        trainer.train()
    assert "--keep-last" in e.value.hint and "--step 1" in e.value.hint
    assert trainer.state.best_global_step == 1
    assert [s for s, _ in layout.committed_steps(root)] == [2]
    assert stagerd.stager is None  # closed: the Trainer ends without on_train_end
    assert not list((tmp_path / "out").glob("*"))
