"""`stagerd watch --adopt` beside a real HF `Trainer` training a PEFT LoRA model under FSDP2, the same run
with each `state_dict_type`. `FULL_STATE_DICT`: the checkpoint holds what `PeftModel.save_pretrained`
writes, published as it is. `SHARDED_STATE_DICT`: the Trainer saves the adapter alone in DCP, under PEFT's
names, and no adapter_config.json: refused by name until one is given with --extras, then published as
PEFT writes it, equal to the other run's. Without LoRA, `FULL_STATE_DICT` writes `save_pretrained`'s
`model.safetensors` (`pytorch_model_fsdp.bin` is never read)."""

from __future__ import annotations

import pytest

from tests.adopt.helpers import published, tree_digest, watch_once
from tests.adopt.trainers import hf_trainer_lora, tiny
from tests.cli_helpers import run_cli
from tests.daemon_helpers import free_port
from tests.fidelity.harness import assert_same_tensors
from tests.gloo import launch

pytestmark = pytest.mark.slow


def _run(tmp, state_dict_type, lora=True):
    run = tmp / state_dict_type
    launch(hf_trainer_lora.train, str(run), state_dict_type, lora, free_port(), world=2, deadline_s=240)
    return run, run / f"checkpoint-{tiny.STEPS}"


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("lora"), "FULL_STATE_DICT")


def _base():
    import torch
    import transformers as tf

    torch.manual_seed(hf_trainer_lora.LORA_SEED)
    return tf.LlamaForCausalLM(tiny.config())


def test_a_full_state_dict_adapter_is_published_as_peft_writes_it_and_loads(full, tmp_path):
    import torch
    from peft import PeftModel

    run, ckpt = full
    before = tree_digest(run)
    res = watch_once(run, tmp_path / "sink")
    assert "1 step(s) published, 0 not" in res.stdout + res.stderr, res.stdout + res.stderr
    pub = published(tmp_path / "sink", tiny.STEPS)
    for name in ("adapter_model.safetensors", "adapter_config.json"):
        assert (pub / name).read_bytes() == (ckpt / name).read_bytes(), name
    assert not list(pub.glob("model*.safetensors*")) and tree_digest(run) == before

    ids = torch.arange(3, 19).reshape(2, 8)
    with torch.no_grad():
        plain = _base()(ids).logits
        tuned = PeftModel.from_pretrained(_base(), pub).eval()(ids).logits
    assert not torch.allclose(plain, tuned)  # the trained adapter is loaded, not PEFT's zero-initialised B


def test_a_sharded_adapter_is_published_as_peft_writes_it_given_its_config(full, tmp_path):
    import torch
    from peft import LoraConfig, PeftModel
    from safetensors.torch import load_file

    from stagerd.engine.adopt.detect import choose_preset

    run, ckpt = _run(tmp_path, "SHARDED_STATE_DICT")
    assert (ckpt / "pytorch_model_fsdp_0" / ".metadata").is_file() and not (
        ckpt / "adapter_config.json"
    ).exists()
    assert all(choose_preset(ckpt, name).adapter for name in ("auto", "hf-trainer"))
    before = tree_digest(run)
    res = watch_once(run, tmp_path / "sink")
    out = res.stdout + res.stderr
    assert res.returncode != 0 and "0 step(s) published, 1 not" in out, out
    assert "without its adapter_config.json" in out, out

    extras = tmp_path / "extras"  # the user's LoraConfig, as PEFT saves it
    LoraConfig(r=2, target_modules=["q_proj", "v_proj"]).save_pretrained(str(extras))
    assert run_cli(["retry", run]).returncode == 0  # the quarantined step, its cause fixed
    res = watch_once(run, tmp_path / "sink", "--extras", str(extras))
    assert "1 step(s) published, 0 not" in res.stdout + res.stderr, res.stdout + res.stderr
    pub = published(tmp_path / "sink", tiny.STEPS)
    assert sorted(p.name for p in pub.iterdir() if p.suffix != ".json") == ["adapter_model.safetensors"]
    got, want = load_file(pub / "adapter_model.safetensors"), load_file(full[1] / "adapter_model.safetensors")
    assert sorted(got) == sorted(want)  # PEFT's own names
    for k in want:
        torch.testing.assert_close(got[k], want[k])  # the same training, saved the other way
    ids = torch.arange(3, 19).reshape(2, 8)
    with torch.no_grad():
        a = PeftModel.from_pretrained(_base(), pub).eval()(ids).logits
        b = PeftModel.from_pretrained(_base(), full[1]).eval()(ids).logits
    torch.testing.assert_close(a, b)
    assert tree_digest(run) == before


def test_a_full_state_dict_model_is_published_as_the_trainers_save_pretrained(tmp_path):
    run, ckpt = _run(tmp_path, "FULL_STATE_DICT", lora=False)
    assert (ckpt / "pytorch_model_fsdp.bin").is_file()
    res = watch_once(run, tmp_path / "sink")
    assert "1 step(s) published, 0 not" in res.stdout + res.stderr, res.stdout + res.stderr
    assert_same_tensors(published(tmp_path / "sink", tiny.STEPS), ckpt)
