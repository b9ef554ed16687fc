"""`StagerdCallback` in TRL's trainers beyond `SFTTrainer`, one process on CPU, tiny models from configs:
`DPOTrainer` with a reference model and with LoRA (the reference is the adapter-disabled base),
`RewardTrainer` on a sequence-classification model, and `GRPOTrainer` (generation on CPU). Each run
resumed from its staged step 2 goes on as the uninterrupted run, bit for bit (dropout on), and the
daemon's export of the last step is what `save_pretrained` writes: the policy alone (no reference
model), the classification head, or the merged model beside the adapter."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from stagerd.contract import layout
from tests.fidelity import harness, models
from tests.integrations.hf_ranks import SEQ, model, tokenizer

pytestmark = pytest.mark.slow
STEPS, EVERY = 4, 2
KINDS = ["dpo", "dpo-lora", "reward", "grpo"]


def _text(g: torch.Generator, n: int) -> str:
    return " ".join(f"t{i}" for i in torch.randint(3, models.VOCAB, (n,), generator=g).tolist())


def _preferences() -> Any:
    from datasets import Dataset

    g = torch.Generator().manual_seed(5)
    rows = [(_text(g, 4), _text(g, 4), _text(g, 4)) for _ in range(16)]
    return Dataset.from_dict(
        {k: [r[i] for r in rows] for i, k in enumerate(("prompt", "chosen", "rejected"))}
    )


def _scorer(seed: int) -> Any:
    import transformers as tf

    torch.manual_seed(seed)
    config = models.config("llama_tied")
    config.attention_dropout, config.num_labels, config.pad_token_id = 0.1, 1, 0
    return tf.AutoModelForSequenceClassification.from_config(config)


def _length_reward(completions: list[str], **kwargs: Any) -> list[float]:
    return [len(c) / 10 for c in completions]


def _trainer(kind: str, out: Path, root: Path, seed: int) -> Any:
    import trl
    from peft import LoraConfig

    from stagerd.integrations.transformers import StagerdCallback

    common: dict[str, Any] = dict(
        output_dir=str(out), max_steps=STEPS, save_steps=EVERY, logging_steps=1, learning_rate=1e-2,
        per_device_train_batch_size=2, use_cpu=True, report_to=[], disable_tqdm=True, seed=7, bf16=False,
    )  # fmt: skip
    given: dict[str, Any] = dict(processing_class=tokenizer(), callbacks=[StagerdCallback(root=root)])
    if kind.startswith("dpo"):
        if kind == "dpo":
            given["ref_model"] = model(3)
        else:
            given["peft_config"] = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.1)
        args = trl.DPOConfig(**common, max_length=SEQ)
        return trl.DPOTrainer(model=model(seed), args=args, train_dataset=_preferences(), **given)
    if kind == "reward":
        args = trl.RewardConfig(**common, max_length=SEQ)
        data = _preferences().remove_columns("prompt")
        return trl.RewardTrainer(model=_scorer(seed), args=args, train_dataset=data, **given)
    common["per_device_train_batch_size"] = 4
    args = trl.GRPOConfig(**common, num_generations=2, max_completion_length=6, beta=0.0)
    data = _preferences().select_columns(["prompt"])
    return trl.GRPOTrainer(
        model=model(seed), reward_funcs=_length_reward, args=args, train_dataset=data, **given
    )


def _losses(trainer: Any) -> dict[int, float]:
    return {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}


def _run(kind: str, tmp: Path) -> tuple[Any, Any]:
    full = _trainer(kind, tmp / "out", tmp / "full", seed=0)
    full.train()
    name = layout.step_dir_name(EVERY)
    shutil.copytree(tmp / "full" / name, tmp / "resumed" / name)
    resumed = _trainer(kind, tmp / "out", tmp / "resumed", seed=1)
    resumed.train(resume_from_checkpoint=str(tmp / "resumed"))
    return full, resumed


def _same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("kind", KINDS)
def test_a_trl_trainer_resumes_bit_for_bit_and_exports_as_save_pretrained(tmp_path, kind):
    full, resumed = _run(kind, tmp_path)
    assert _losses(resumed) == _losses(full) and sorted(_losses(full)) == list(range(1, STEPS + 1))
    assert _same_state(full.model.state_dict(), resumed.model.state_dict())
    assert not list((tmp_path / "out").glob("checkpoint-*"))

    harness.export(tmp_path / "full", tmp_path / "sink")
    export = tmp_path / "sink" / layout.step_dir_name(STEPS)
    check: Callable[[Path, Any], None] = _check_lora if kind == "dpo-lora" else _check_whole
    check(export, full.model)


def _check_whole(export: Path, live: Any) -> None:
    live.save_pretrained(export.parent / "ref")
    harness.assert_same_weight_files(export, export.parent / "ref")
    config = json.loads((export / "config.json").read_text())
    assert config == json.loads((export.parent / "ref" / "config.json").read_text())


def _check_lora(export: Path, live: Any) -> None:
    import transformers as tf

    live.save_pretrained(export.parent / "adapter-ref")
    harness.assert_same_tensors(export / "adapter", export.parent / "adapter-ref")
    merged = tf.AutoModelForCausalLM.from_pretrained(export).state_dict()
    assert _same_state(merged, live.merge_and_unload().state_dict())
