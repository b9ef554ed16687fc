"""A LightningModule holding a PEFT LoRA model (`self.model = get_peft_model(...)`), saved through
`StagerdCheckpointIO` with `model=` the module or the PEFT model inside it, either compiled: the daemon's
export is what `save_pretrained` of `merge_and_unload()` writes, with the adapter PEFT's `save_pretrained`
writes in `adapter/` (as `Stager.save(model=peft_model)` gives in a loop of one's own), and
`fit(ckpt_path=...)` resumes bit for bit. A plain transformers model given as `model=module.model` exports
as its `save_pretrained` writes it. One process, a real Lightning Trainer on CPU, a tiny Llama built from
its config."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

from stagerd.contract import layout
from tests.fidelity import harness

pytestmark = pytest.mark.slow


def _module(head: bool, compiled: bool = False, lora: bool = True) -> Any:
    import lightning.pytorch as pl
    import transformers as tf
    from peft import LoraConfig, get_peft_model

    config = tf.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                            num_attention_heads=2, num_key_value_heads=1)  # fmt: skip
    adapters = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])

    class Lit(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = tf.AutoModelForCausalLM.from_config(config)
            if lora:
                self.model = get_peft_model(self.model, adapters)
            if compiled:  # on CPU with the `aot_eager` backend: no C compiler needed
                self.model = torch.compile(self.model, backend="aot_eager")
            # a tensor of the module's own beside the model: saved and resumed, not exported
            self.scale = torch.nn.Parameter(torch.ones(1)) if head else None
            self.losses: dict[int, float] = {}

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            loss = self.model(input_ids=batch[0], labels=batch[0]).loss
            if self.scale is not None:
                loss = loss * self.scale.sum()
            self.losses[self.global_step + 1] = loss.item()
            return loss

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2)

    return Lit()


def _fit(out: Path, given: str, head: bool, steps: int, ckpt_path: str | None = None) -> Any:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    from stagerd.integrations.lightning import StagerdCheckpointIO

    torch.manual_seed(0)
    module = _module(head, compiled=given == "compiled_peft", lora=given != "plain_model")
    fitted = torch.compile(module, backend="aot_eager") if given == "compiled_module" else module
    # what a user passes: the module as fitted, or the model inside it as the module holds it
    io = StagerdCheckpointIO(out / "root", model=fitted if given.endswith("module") else module.model)
    every = ModelCheckpoint(dirpath=out / "ckpts", every_n_train_steps=2, save_top_k=-1, filename="{step}")
    trainer = pl.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, plugins=[io],
                         callbacks=[every])  # fmt: skip
    torch.manual_seed(1)
    # two steps an epoch: the checkpoint at an epoch's end, which Lightning resumes exactly
    data = torch.utils.data.TensorDataset(torch.randint(0, 64, (4, 8)))
    trainer.fit(fitted, torch.utils.data.DataLoader(data, batch_size=2), ckpt_path=ckpt_path)
    io.teardown()
    return module


CASES = [
    ("module", False),
    ("peft", False),
    ("module", True),
    ("compiled_module", False),
    ("compiled_peft", False),
    ("plain_model", False),
]


@pytest.mark.parametrize(("given", "head"), CASES)
def test_the_model_inside_a_module_exports_as_its_save_pretrained_and_resumes(tmp_path, given, head):
    from stagerd.integrations.lightning import load_from_checkpoint

    full = _fit(tmp_path / "full", given, head, steps=4)
    resumed = _fit(tmp_path / "resumed", given, head, 4, str(tmp_path / "full" / "ckpts" / "step=2.ckpt"))
    assert list(resumed.losses) == [3, 4]
    assert resumed.losses == {k: full.losses[k] for k in (3, 4)}
    want = full.state_dict()
    assert all(torch.equal(resumed.state_dict()[k], v) for k, v in want.items())
    loaded = load_from_checkpoint(type(full), tmp_path / "full" / "ckpts" / "step=4.ckpt").state_dict()
    assert loaded.keys() == want.keys() and all(torch.equal(loaded[k], v) for k, v in want.items())

    harness.export(tmp_path / "full" / "root", tmp_path / "sink")
    export = tmp_path / "sink" / layout.step_dir_name(4)
    if given == "plain_model":
        full.model.save_pretrained(tmp_path / "ref")
        assert not (export / "adapter").exists()
    else:
        peft_model = getattr(full.model, "_orig_mod", full.model)
        peft_model.save_pretrained(tmp_path / "ref" / "adapter")
        copy.deepcopy(peft_model).merge_and_unload().save_pretrained(tmp_path / "ref")
        harness.assert_same_tensors(export / "adapter", tmp_path / "ref" / "adapter")
    harness.assert_same_tensors(export, tmp_path / "ref")
    assert (export / "config.json").read_bytes() == (tmp_path / "ref" / "config.json").read_bytes()


def test_a_save_after_fit_of_the_last_step_checks_the_staged_weights(tmp_path):
    from stagerd.errors import SaveInputError

    module = _fit(tmp_path, "module", head=True, steps=2)
    trainer = module.trainer
    trainer.save_checkpoint(tmp_path / "same.ckpt")  # the step ModelCheckpoint staged, unchanged
    with torch.no_grad():
        module.scale.add_(1.0)  # a tensor of the module outside the exported model
    with pytest.raises(SaveInputError, match="already staged with other weights"):
        trainer.save_checkpoint(tmp_path / "changed.ckpt")
    trainer.strategy.checkpoint_io.teardown()
