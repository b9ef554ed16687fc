"""`StagerdCallback` in TRL's `SFTTrainer` training LoRA adapters (`peft_config=LoraConfig(...)`, one
process, dropout in the adapters): a run resumed from a staged step, whose optimizer holds the adapters'
state alone, goes on as the uninterrupted run, bit for bit; the daemon's export of the last step holds
the merged model, which `from_pretrained` loads as `merge_and_unload()` of the live model, and
`adapter/`, which `PeftModel.from_pretrained` loads as the live adapters."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from stagerd.contract import layout
from tests.fidelity import harness
from tests.integrations.hf_ranks import SEQ, dataset, model, tokenizer

pytestmark = pytest.mark.slow
STEPS, EVERY = 4, 2


def _trainer(out: Path, root: Path) -> Any:
    from peft import LoraConfig
    from trl import SFTConfig, SFTTrainer

    from stagerd.integrations.transformers import StagerdCallback

    args = SFTConfig(
        output_dir=str(out), max_steps=STEPS, save_steps=EVERY, logging_steps=1, max_length=SEQ,
        per_device_train_batch_size=2, learning_rate=1e-2, use_cpu=True, report_to=[], disable_tqdm=True,
        seed=7, bf16=False,
    )  # fmt: skip
    lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.1)
    return SFTTrainer(model=model(0), args=args, train_dataset=dataset(), processing_class=tokenizer(),
                      peft_config=lora, callbacks=[StagerdCallback(root=root)])  # fmt: skip


def _losses(trainer: Any) -> dict[int, float]:
    return {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}


def test_a_lora_run_resumes_bit_for_bit_and_exports_the_merged_model_and_adapter(tmp_path):
    import transformers as tf
    from peft import PeftModel

    full = _trainer(tmp_path / "out", tmp_path / "full")
    full.train()
    name = layout.step_dir_name(EVERY)
    shutil.copytree(tmp_path / "full" / name, tmp_path / "resumed" / name)
    resumed = _trainer(tmp_path / "out", tmp_path / "resumed")
    cb = next(c for c in resumed.callback_handler.callbacks if c.__class__.__name__ == "StagerdCallback")
    resumed.train(resume_from_checkpoint=cb.resume(resumed))

    assert _losses(resumed) == _losses(full) and sorted(_losses(full)) == list(range(1, STEPS + 1))
    live = full.model.state_dict()
    assert all(torch.equal(v, resumed.model.state_dict()[k]) for k, v in live.items())

    harness.export(tmp_path / "full", tmp_path / "sink")
    export = tmp_path / "sink" / layout.step_dir_name(STEPS)
    adapter = PeftModel.from_pretrained(model(1), export / "adapter").state_dict()
    lora = [k for k in live if ".lora_" in k]
    assert lora and all(torch.equal(adapter[k], live[k]) for k in lora)
    merged = tf.AutoModelForCausalLM.from_pretrained(export).state_dict()
    want = full.model.merge_and_unload().state_dict()
    assert merged.keys() == want.keys() and all(torch.equal(merged[k], want[k]) for k in want)
