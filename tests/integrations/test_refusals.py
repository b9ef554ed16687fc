"""What the callback refuses, before anything is trained or saved (one process, a real Trainer)."""

from __future__ import annotations

import pytest

from stagerd.errors import ConfigError, SaveInputError
from tests.integrations.hf_ranks import model


def _trainer(tmp_path, callbacks=None):
    import transformers as tf

    args = tf.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    return tf.Trainer(model=model(0), args=args, callbacks=callbacks)


def test_the_callbacks_own_arguments_are_refused():
    from stagerd.integrations.transformers import StagerdCallback

    with pytest.raises(SaveInputError, match=r"gives \['model'\] itself"):
        StagerdCallback(root="/nonexistent", model=object())


@pytest.mark.parametrize("how", ["callbacks", "add_callback"])
def test_the_class_itself_is_refused_with_a_hint(tmp_path, how):
    """transformers makes a callback given as a class with no arguments: StagerdCallback needs ROOT."""
    from stagerd.integrations.transformers import StagerdCallback

    with pytest.raises(ConfigError, match="root") as e:
        if how == "callbacks":
            _trainer(tmp_path, callbacks=[StagerdCallback])
        else:
            _trainer(tmp_path).add_callback(StagerdCallback)
    assert "StagerdCallback(root=" in e.value.hint


def test_a_callback_serving_a_trainer_is_not_added_to_another_until_removed(tmp_path):
    from stagerd.integrations.transformers import StagerdCallback

    cb = StagerdCallback(root=tmp_path / "root")
    first, second = _trainer(tmp_path, callbacks=[cb]), _trainer(tmp_path)
    with pytest.raises(ConfigError, match="serves one Trainer"):
        second.add_callback(cb)
    assert cb not in second.callback_handler.callbacks  # refused: not left there, unbound
    assert "_save_checkpoint" not in second.__dict__

    first.remove_callback(cb)
    assert "_save_checkpoint" not in first.__dict__
    second.add_callback(cb)
    assert "_save_checkpoint" in second.__dict__


@pytest.mark.parametrize("how", ["callbacks", "add_callback"])
def test_a_second_callback_on_one_trainer_is_refused(tmp_path, how):
    from stagerd.integrations.transformers import StagerdCallback

    first, second = StagerdCallback(root=tmp_path / "a"), StagerdCallback(root=tmp_path / "b")
    if how == "callbacks":
        with pytest.raises(ConfigError, match="already has a StagerdCallback"):
            _trainer(tmp_path, callbacks=[first, second])
        return
    trainer = _trainer(tmp_path, callbacks=[first])
    with pytest.raises(ConfigError, match="already has a StagerdCallback"):
        trainer.add_callback(second)
    assert second not in trainer.callback_handler.callbacks
    assert second._trainer is None
    trainer.remove_callback(first)
    trainer.add_callback(second)  # one at a time is fine
    assert second._trainer is trainer
