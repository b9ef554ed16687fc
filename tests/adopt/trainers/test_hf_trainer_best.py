"""`stagerd watch --adopt --keep-last 1 --delete-adopted` beside a real HF `Trainer` with
`load_best_model_at_end`: the checkpoint its `trainer_state.json` names as the best (not the newest) is
kept beside the newest, as the Trainer's own rotation keeps it, so the Trainer still loads it at the end;
the others beyond keep-last go."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.adopt.helpers import published, watch_once
from tests.integrations.hf_ranks import dataset, model, tokenizer

pytestmark = pytest.mark.slow
STEPS = 3


def _trainer(out: Any, max_steps: int) -> Any:
    import transformers as tf

    evals: list[int] = []

    def first_is_best(_: Any) -> dict[str, float]:
        evals.append(1)
        return {"score": -float(len(evals))}  # the first evaluation's is the highest

    args = tf.TrainingArguments(
        output_dir=str(out), max_steps=max_steps, save_steps=1, eval_strategy="steps", eval_steps=1,
        load_best_model_at_end=True, metric_for_best_model="score", greater_is_better=True,
        per_device_train_batch_size=2, learning_rate=1e-2, use_cpu=True, report_to=[], disable_tqdm=True,
    )  # fmt: skip
    tok = tokenizer()
    return tf.Trainer(
        model=model(0), args=args, train_dataset=dataset(), eval_dataset=dataset().select(range(2)),
        processing_class=tok, data_collator=tf.DataCollatorForLanguageModeling(tok, mlm=False),
        compute_metrics=first_is_best,
    )  # fmt: skip


def test_the_trainers_best_checkpoint_is_kept_and_loaded_at_the_end(tmp_path):
    run = tmp_path / "run"
    first = _trainer(run, STEPS - 1)
    first.train()  # a run killed after step 2, its best checkpoint-1
    res = watch_once(run, tmp_path / "sink", "--keep-last", "1", "--delete-adopted")
    assert res.returncode == 0 and "2 step(s) published" in res.stdout, res.stdout + res.stderr
    assert sorted(p.name for p in run.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2"]

    resumed = _trainer(run, STEPS)
    resumed.train(resume_from_checkpoint=True)  # step 3, then the best model loaded from checkpoint-1
    assert resumed.state.best_global_step == 1
    res = watch_once(run, tmp_path / "sink", "--keep-last", "1", "--delete-adopted")
    assert res.returncode == 0, res.stdout + res.stderr
    assert sorted(p.name for p in run.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-3"]
    assert all(published(tmp_path / "sink", s).is_dir() for s in range(1, STEPS + 1))

    import transformers as tf

    best = tf.AutoModelForCausalLM.from_pretrained(run / "checkpoint-1").state_dict()
    final = resumed.model.state_dict()
    assert all(torch.equal(final[k], best[k]) for k in best)
