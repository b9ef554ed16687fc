"""What the callback refuses, before anything is trained or saved (one process, a real Trainer)."""

from __future__ import annotations

import pytest

from stagerd.errors import ConfigError, SaveInputError


def test_the_callbacks_own_arguments_are_refused():
    from stagerd.integrations.transformers import StagerdCallback

    with pytest.raises(SaveInputError, match=r"gives \['model'\] itself"):
        StagerdCallback(root="/nonexistent", model=object())


def test_load_best_model_at_end_is_refused_at_the_start_of_training(tmp_path):
    import transformers as tf

    from stagerd.integrations.transformers import StagerdCallback
    from tests.integrations import hf_ranks

    args = tf.TrainingArguments(
        output_dir=str(tmp_path / "out"), max_steps=2, eval_strategy="steps", save_steps=1, eval_steps=1,
        load_best_model_at_end=True, use_cpu=True, report_to=[], disable_tqdm=True,
    )  # fmt: skip
    ds = hf_ranks.dataset()
    trainer = tf.Trainer(model=hf_ranks.model(0), args=args, train_dataset=ds, eval_dataset=ds,
                         callbacks=[StagerdCallback(root=tmp_path / "root")])  # fmt: skip
    with pytest.raises(ConfigError, match="does not load the best model"):
        trainer.train()
    assert not (tmp_path / "root").exists() or not any((tmp_path / "root").iterdir())
