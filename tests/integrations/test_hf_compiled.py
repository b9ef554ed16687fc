"""`StagerdCallback` in a Trainer given a model the user compiled (`model=torch.compile(model)`, on CPU with
the `aot_eager` backend: no C compiler needed). The Trainer holds the `OptimizedModule`, whose
`state_dict` keys carry `_orig_mod.` and whose `get_model_state_dict` keys do not: the daemon's export of
each step is still what `save_pretrained` writes of the model inside, and a run resumed from a staged
step goes on as the uninterrupted run, bit for bit."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from stagerd.contract import layout
from tests.fidelity import harness
from tests.integrations.hf_ranks import dataset, model, tokenizer

pytestmark = pytest.mark.slow
STEPS, EVERY = 4, 2


def _trainer(out: Path, root: Path, seed: int) -> Any:
    import transformers as tf

    from stagerd.integrations.transformers import StagerdCallback

    args = tf.TrainingArguments(
        output_dir=str(out), max_steps=STEPS, save_steps=EVERY, logging_steps=1,
        per_device_train_batch_size=2, learning_rate=1e-2, use_cpu=True, report_to=[], disable_tqdm=True,
        seed=7,
        remove_unused_columns=False,  # the compiled module's forward takes (*args, **kwargs)
    )  # fmt: skip
    tok = tokenizer()
    compiled = torch.compile(model(seed), backend="aot_eager")
    collator = tf.DataCollatorForLanguageModeling(tok, mlm=False)
    return tf.Trainer(model=compiled, args=args, train_dataset=dataset(), processing_class=tok,
                      data_collator=collator, callbacks=[StagerdCallback(root=root)])  # fmt: skip


def _losses(trainer: Any) -> dict[int, float]:
    return {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}


def test_a_compiled_models_steps_export_as_save_pretrained_and_resume_bit_for_bit(tmp_path):
    full = _trainer(tmp_path / "out", tmp_path / "full", seed=0)
    full.train()
    inner = full.model._orig_mod
    inner.save_pretrained(tmp_path / "ref")

    harness.export(tmp_path / "full", tmp_path / "sink")
    export = tmp_path / "sink" / layout.step_dir_name(STEPS)
    harness.assert_same_weight_files(export, tmp_path / "ref")  # not an empty index: every weight is there
    for name in ("config.json", "generation_config.json"):
        assert json.loads((export / name).read_text()) == json.loads((tmp_path / "ref" / name).read_text())

    name = layout.step_dir_name(EVERY)
    shutil.copytree(tmp_path / "full" / name, tmp_path / "resumed" / name)
    resumed = _trainer(tmp_path / "out", tmp_path / "resumed", seed=1)
    resumed.train(resume_from_checkpoint=str(tmp_path / "resumed"))
    assert _losses(resumed) == _losses(full) and sorted(_losses(full)) == list(range(1, STEPS + 1))
    want, got = inner.state_dict(), resumed.model._orig_mod.state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)
