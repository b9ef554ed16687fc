"""`stagerd watch --adopt` on what a real HF `Trainer` writes without FSDP (one process here; DDP writes
the same from rank 0): `checkpoint-N/` holding `save_pretrained`'s files, then the tokenizer's, the
optimizer, RNG and scheduler, and `trainer_state.json` last. A copy cut before the tokenizer (as a daemon
finds it while the Trainer still writes) must not be exported: done then, it would lack the tokenizer and
trainer state for good, the save's model files being the same once it finishes."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.adopt.helpers import assert_passed_over_once, published, tree_digest, watch_once
from tests.cli_helpers import run_cli
from tests.fidelity.harness import assert_same_tensors
from tests.integrations.hf_ranks import dataset, model, tokenizer

pytestmark = pytest.mark.slow
STEP = 2
MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors")  # save_pretrained's


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    import transformers as tf

    out = tmp_path_factory.mktemp("plain")
    args = tf.TrainingArguments(
        output_dir=str(out / "run"),
        use_cpu=True,
        max_steps=STEP,
        save_steps=STEP,
        per_device_train_batch_size=2,
        report_to=[],
        disable_tqdm=True,
    )
    tok = tokenizer()
    collator = tf.DataCollatorForLanguageModeling(tok, mlm=False)
    trainer = tf.Trainer(
        model=model(0), args=args, train_dataset=dataset(), processing_class=tok, data_collator=collator
    )
    trainer.train()
    # a loop of the user's saving with Accelerate, under the Trainer's kind of name: no trainer_state.json
    trainer.accelerator.save_state(str(out / "accelerate" / f"checkpoint-{STEP}"))
    return out


def test_a_checkpoint_still_being_saved_is_not_exported_the_finished_one_is_whole(trained, tmp_path):
    ckpt = trained / "run" / f"checkpoint-{STEP}"
    watched = tmp_path / "run"
    mid = watched / ckpt.name
    mid.mkdir(parents=True)
    for name in MODEL_FILES:  # the model saved; the tokenizer, optimizer and trainer_state.json not yet
        shutil.copy2(ckpt / name, mid / name)
    sink = tmp_path / "sink"
    res = watch_once(watched, sink)
    assert res.returncode == 0, res.stdout + res.stderr
    assert not published(sink, STEP).exists()

    for p in ckpt.iterdir():  # the Trainer finishes its save
        if not (mid / p.name).exists():
            shutil.copy2(p, mid / p.name)
    before = tree_digest(watched)
    res = watch_once(watched, sink)
    assert "1 step(s) published, 0 not" in res.stdout + res.stderr, res.stdout + res.stderr
    out = published(sink, STEP)
    assert_same_tensors(out, ckpt)
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (ckpt / name).read_bytes(), name
    options = json.loads((watched / ".stagerd" / "adopted" / ckpt.name / "export.options.json").read_text())
    assert options["preset"] == "hf-trainer"
    assert tree_digest(watched) == before  # the Trainer's files only read


def test_accelerates_save_state_is_exported_under_a_trainers_name_too(trained, tmp_path):
    watched = trained / "accelerate"
    res = watch_once(watched, tmp_path / "sink")
    assert "1 step(s) published, 0 not" in res.stdout + res.stderr, res.stdout + res.stderr
    assert_same_tensors(published(tmp_path / "sink", STEP), trained / "run" / f"checkpoint-{STEP}")


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """A real Trainer run of a PEFT LoRA model: `checkpoint-1/` holds what `PeftModel.save_pretrained`
    writes (the adapter alone), the tokenizer, and `trainer_state.json` last. The base model is saved
    first, so `adapter_config.json` names a directory `from_pretrained` reads."""
    import transformers as tf
    from peft import LoraConfig, get_peft_model

    out = tmp_path_factory.mktemp("lora")
    model(0).save_pretrained(out / "base")
    base = tf.AutoModelForCausalLM.from_pretrained(out / "base")
    lora = get_peft_model(base, LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    args = tf.TrainingArguments(
        output_dir=str(out / "run"),
        use_cpu=True,
        max_steps=1,
        save_steps=1,
        learning_rate=5e-2,
        report_to=[],
        disable_tqdm=True,
    )
    tok = tokenizer()
    collator = tf.DataCollatorForLanguageModeling(tok, mlm=False)
    tf.Trainer(
        model=lora, args=args, train_dataset=dataset(), processing_class=tok, data_collator=collator
    ).train()
    return out, lora.eval()


def _logits(m):
    import torch

    with torch.no_grad():
        return m(torch.arange(3, 19).reshape(2, 8)).logits


def test_a_peft_adapters_checkpoint_is_exported_as_peft_saves_it_and_loads(lora_run, tmp_path):
    """The Trainer saves a PEFT model's adapter alone (`adapter_model.safetensors`). It is published as
    `PeftModel.save_pretrained` / `push_to_hub` would put it: the same bytes, its config, the tokenizer,
    and no base weights; `PeftModel.from_pretrained` and `AutoModelForCausalLM.from_pretrained` (which
    reads the base's path from adapter_config.json) give the trained model's logits."""
    import torch
    import transformers as tf
    from peft import PeftModel

    out, trained = lora_run
    ckpt = out / "run" / "checkpoint-1"
    assert (ckpt / "adapter_model.safetensors").is_file() and not (ckpt / "model.safetensors").exists()
    before = tree_digest(out / "run")
    res = watch_once(out / "run", tmp_path / "sink")
    log = res.stdout + res.stderr
    assert res.returncode == 0 and "1 step(s) published, 0 not" in log, log
    assert "PEFT adapter" not in log, log
    pub = published(tmp_path / "sink", 1)
    for name in (
        "adapter_model.safetensors",
        "adapter_config.json",
        "README.md",  # PEFT's card: library_name peft, base_model
        "tokenizer.json",
        "tokenizer_config.json",
    ):
        assert (pub / name).read_bytes() == (ckpt / name).read_bytes(), name
    assert not list(pub.glob("model*.safetensors*")) and not (pub / "config.json").exists()
    assert tree_digest(out / "run") == before  # the Trainer's files only read

    want = _logits(trained)
    base = tf.AutoModelForCausalLM.from_pretrained(out / "base")
    assert not torch.allclose(_logits(base), want)  # the adapter changes the model
    torch.testing.assert_close(_logits(PeftModel.from_pretrained(base, pub).eval()), want)
    torch.testing.assert_close(_logits(tf.AutoModelForCausalLM.from_pretrained(pub).eval()), want)

    # The export is whole to the daemon, and verify and consolidate read it as it is named.
    again = watch_once(out / "run", tmp_path / "sink2")
    assert again.returncode == 0 and "has no weights" not in again.stdout + again.stderr, again.stderr
    assert published(tmp_path / "sink2", 1).joinpath("adapter_model.safetensors").is_file()
    checked = run_cli(["verify", pub, "--against", ckpt, "--adopt"])
    assert checked.returncode == 0, checked.stdout + checked.stderr
    made = run_cli(["consolidate", ckpt, tmp_path / "made", "--adopt"])
    assert made.returncode == 0, made.stdout + made.stderr
    made_file = tmp_path / "made" / "adapter_model.safetensors"
    assert made_file.read_bytes() == (ckpt / "adapter_model.safetensors").read_bytes()


def test_an_adapter_saved_as_a_pickle_is_named_once_and_left_alone(lora_run, tmp_path):
    """`save_pretrained(safe_serialization=False)` writes `adapter_model.bin`, a pickle stagerd never
    reads: the finished checkpoint is named once in a warning, nothing is published, its files stay."""
    ckpt = tmp_path / "run" / "checkpoint-1"
    shutil.copytree(lora_run[0] / "run" / "checkpoint-1", ckpt)
    (ckpt / "adapter_model.safetensors").rename(ckpt / "adapter_model.bin")  # never opened: any bytes
    said = "checkpoint-1 holds a PEFT adapter as adapter_model.bin"
    assert_passed_over_once(tmp_path / "run", tmp_path / "sink", said)
