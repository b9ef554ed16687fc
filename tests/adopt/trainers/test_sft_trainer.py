"""`stagerd watch --adopt` on what TRL's `SFTTrainer` writes (one CPU process; DDP writes the same from
rank 0): a full fine-tune's `checkpoint-N/` holds `save_pretrained`'s files, and with
`peft_config=LoraConfig(...)` the adapter alone, as `PeftModel.save_pretrained` writes it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.adopt.helpers import published, tree_digest, watch_once
from tests.fidelity.harness import assert_same_tensors
from tests.integrations.hf_ranks import SEQ, dataset, model, tokenizer

pytestmark = pytest.mark.slow
STEP = 1


def _sft(out: Path, base: Any, **kw: Any) -> Any:
    from trl import SFTConfig, SFTTrainer

    args = SFTConfig(
        output_dir=str(out), max_steps=STEP, save_steps=STEP, per_device_train_batch_size=2,
        learning_rate=5e-2, use_cpu=True, bf16=False, max_length=SEQ, report_to=[], disable_tqdm=True,
    )  # fmt: skip
    trainer = SFTTrainer(model=base, args=args, train_dataset=dataset(), processing_class=tokenizer(), **kw)
    trainer.train()
    return trainer


def _logits(m: Any) -> Any:
    import torch

    with torch.no_grad():
        return m.eval()(torch.arange(3, 19).reshape(2, 8)).logits


def test_a_full_fine_tunes_checkpoint_is_published_as_save_pretrained_writes_it(tmp_path):
    trainer = _sft(tmp_path / "run", model(0))
    trainer.model.save_pretrained(tmp_path / "ref")
    before = tree_digest(tmp_path / "run")
    res = watch_once(tmp_path / "run", tmp_path / "sink")
    assert "1 step(s) published, 0 not" in res.stdout + res.stderr, res.stdout + res.stderr
    pub = published(tmp_path / "sink", STEP)
    assert_same_tensors(pub, tmp_path / "ref")
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (pub / name).is_file(), name
    assert tree_digest(tmp_path / "run") == before


def test_a_lora_adapter_is_published_as_peft_writes_it_and_loads_into_its_base(tmp_path):
    import torch
    import transformers as tf
    from peft import LoraConfig, PeftModel

    model(0).save_pretrained(tmp_path / "base")  # so adapter_config.json names a base that loads
    base = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    lora = LoraConfig(r=2, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    _sft(tmp_path / "run", base, peft_config=lora)
    ckpt = tmp_path / "run" / f"checkpoint-{STEP}"
    assert (ckpt / "adapter_model.safetensors").is_file() and not (ckpt / "model.safetensors").exists()

    res = watch_once(tmp_path / "run", tmp_path / "sink", "--dtype", "bf16")
    assert "1 step(s) published, 0 not" in res.stdout + res.stderr, res.stdout + res.stderr
    pub = published(tmp_path / "sink", STEP)
    assert not list(pub.glob("model*.safetensors*")) and not (pub / "config.json").exists()
    for name in ("adapter_config.json", "README.md", "tokenizer.json"):
        assert (pub / name).read_bytes() == (ckpt / name).read_bytes(), name

    from safetensors.torch import load_file

    got, want = load_file(pub / "adapter_model.safetensors"), load_file(ckpt / "adapter_model.safetensors")
    assert sorted(got) == sorted(want) and all(t.dtype == torch.bfloat16 for t in got.values())
    assert all(torch.equal(got[k], want[k].to(torch.bfloat16)) for k in want)  # cast as --dtype asks

    fresh = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    want_logits = _logits(PeftModel.from_pretrained(fresh, ckpt))  # the checkpoint as PEFT loads it
    assert not torch.allclose(
        _logits(tf.AutoModelForCausalLM.from_pretrained(tmp_path / "base")), want_logits
    )
    loaded = PeftModel.from_pretrained(tf.AutoModelForCausalLM.from_pretrained(tmp_path / "base"), pub)
    torch.testing.assert_close(_logits(loaded), want_logits, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(
        _logits(tf.AutoModelForCausalLM.from_pretrained(pub)), want_logits, atol=2e-2, rtol=2e-2
    )
