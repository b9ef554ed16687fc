"""`stagerd watch --adopt` beside a real HF `Trainer` training a PEFT LoRA model under FSDP2: with
`FULL_STATE_DICT` the checkpoint holds what `PeftModel.save_pretrained` writes, published as it is; with
`SHARDED_STATE_DICT` the Trainer saves the adapter alone in DCP and no adapter_config.json, which PEFT
could not load: refused by name, saying which setting writes a publishable one. Without LoRA,
`FULL_STATE_DICT` writes `save_pretrained`'s `model.safetensors` (`pytorch_model_fsdp.bin` is never read)."""

from __future__ import annotations

import pytest

from tests.adopt.helpers import published, tree_digest, watch_once
from tests.adopt.trainers import hf_trainer_lora, tiny
from tests.daemon_helpers import free_port
from tests.fidelity.harness import assert_same_tensors
from tests.gloo import launch

pytestmark = pytest.mark.slow


def _run(tmp, state_dict_type, lora=True):
    run = tmp / state_dict_type
    launch(hf_trainer_lora.train, str(run), state_dict_type, lora, free_port(), world=2, deadline_s=240)
    return run, run / f"checkpoint-{tiny.STEPS}"


def test_a_full_state_dict_adapter_is_published_as_peft_writes_it_and_loads(tmp_path):
    import torch
    import transformers as tf
    from peft import PeftModel

    run, ckpt = _run(tmp_path, "FULL_STATE_DICT")
    before = tree_digest(run)
    res = watch_once(run, tmp_path / "sink")
    assert "1 step(s) published, 0 not" in res.stdout + res.stderr, res.stdout + res.stderr
    pub = published(tmp_path / "sink", tiny.STEPS)
    for name in ("adapter_model.safetensors", "adapter_config.json"):
        assert (pub / name).read_bytes() == (ckpt / name).read_bytes(), name
    assert not list(pub.glob("model*.safetensors*")) and tree_digest(run) == before

    torch.manual_seed(hf_trainer_lora.LORA_SEED)
    base = tf.LlamaForCausalLM(tiny.config())
    ids = torch.arange(3, 19).reshape(2, 8)
    with torch.no_grad():
        plain = base(ids).logits
        tuned = PeftModel.from_pretrained(base, pub).eval()(ids).logits
    assert not torch.allclose(plain, tuned)  # the trained adapter is loaded, not PEFT's zero-initialised B


def test_a_sharded_adapter_without_its_config_is_refused_by_name(tmp_path):
    run, ckpt = _run(tmp_path, "SHARDED_STATE_DICT")
    assert (ckpt / "pytorch_model_fsdp_0" / ".metadata").is_file() and not (
        ckpt / "adapter_config.json"
    ).exists()
    before = tree_digest(run)
    res = watch_once(run, tmp_path / "sink")
    out = res.stdout + res.stderr
    assert res.returncode != 0 and "0 step(s) published, 1 not" in out, out
    assert "holds a PEFT adapter alone" in out and "FULL_STATE_DICT" in out, out
    assert tree_digest(run) == before


def test_a_full_state_dict_model_is_published_as_the_trainers_save_pretrained(tmp_path):
    run, ckpt = _run(tmp_path, "FULL_STATE_DICT", lora=False)
    assert (ckpt / "pytorch_model_fsdp.bin").is_file()
    res = watch_once(run, tmp_path / "sink")
    assert "1 step(s) published, 0 not" in res.stdout + res.stderr, res.stdout + res.stderr
    assert_same_tensors(published(tmp_path / "sink", tiny.STEPS), ckpt)
