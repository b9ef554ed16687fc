"""`StagerdCheckpointIO` under Lightning Fabric (`Fabric(plugins=[io])`), the loop unchanged:
`fabric.save(path, state)` stages the state's step with its model exported as `save_pretrained` writes
it, and `fabric.load(path, state)` resumes bit for bit, in one process and on 2 gloo ranks under DDP
(`fabric_loop`). A state whose step or model cannot be told is refused by name before anything is
written; a path the Trainer saved loads through Fabric as Lightning's file does."""

from __future__ import annotations

import json

import pytest
import torch

from stagerd.contract import layout
from stagerd.errors import ConfigError, SaveInputError
from tests.fidelity import harness
from tests.gloo import launch
from tests.integrations import fabric_loop

pytestmark = pytest.mark.slow


def test_a_fabric_loop_resumes_bit_for_bit_and_exports_as_save_pretrained(tmp_path):
    full_losses, full_weights = fabric_loop.fit(tmp_path / "full", tmp_path / "full" / "root", None)
    resume = tmp_path / "full" / f"step-{fabric_loop.SAVE_AT}.ckpt"
    losses, weights = fabric_loop.fit(tmp_path / "resumed", tmp_path / "resumed" / "root", resume)
    assert list(losses) == [3, 4] and losses == {k: full_losses[k] for k in (3, 4)}
    assert all(torch.equal(weights[k], v) for k, v in full_weights.items())

    model = fabric_loop.tiny_llama(0)
    model.load_state_dict(full_weights)
    model.save_pretrained(tmp_path / "ref")
    harness.export(tmp_path / "full" / "root", tmp_path / "sink")
    harness.assert_same_tensors(tmp_path / "sink" / layout.step_dir_name(fabric_loop.STEPS), tmp_path / "ref")


@pytest.mark.slow
def test_a_fabric_ddp_loop_on_two_ranks_resumes_bit_for_bit(tmp_path):
    launch(fabric_loop.run, str(tmp_path), deadline_s=300)
    result = json.loads((tmp_path / "result.json").read_text())
    assert list(result["resumed"]) == ["3", "4"]
    assert result["resumed"] == {k: result["full"][k] for k in ("3", "4")}
    assert result["same_weights"]


def test_a_state_with_no_step_or_no_model_is_refused_by_name_before_anything_is_written(tmp_path):
    from lightning.fabric import Fabric

    from stagerd.integrations.lightning import StagerdCheckpointIO

    fabric = Fabric(accelerator="cpu", devices=1, plugins=[StagerdCheckpointIO(tmp_path / "root")])
    linear = torch.nn.Linear(4, 2)
    model, optimizer = fabric.setup(linear, torch.optim.Adam(linear.parameters()))
    with pytest.raises(ConfigError, match="no int step under 'step'"):
        fabric.save(tmp_path / "a.ckpt", {"model": model, "optimizer": optimizer, "iteration": 3})
    other = fabric.setup(torch.nn.Linear(2, 2))
    with pytest.raises(ConfigError, match="2 entries"):
        fabric.save(tmp_path / "b.ckpt", {"model": model, "other": other, "step": 3})
    assert not (tmp_path / "a.ckpt").exists() and not (tmp_path / "b.ckpt").exists()
    assert not (tmp_path / "root").exists()
    # `step_key` names another key; model= tells the model among several
    io = StagerdCheckpointIO(tmp_path / "root", model=linear, step_key="iteration")
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[io])
    fabric.save(tmp_path / "c.ckpt", {"model": model, "other": other, "iteration": 3})
    state = {"model": model, "other": other, "iteration": 0}
    fabric.load(tmp_path / "c.ckpt", state)
    assert state["iteration"] == 3
    fabric.save(tmp_path / "same.ckpt", {"model": model, "other": other, "iteration": 3})  # a second path
    with torch.no_grad():
        linear.weight.add_(1.0)
    with pytest.raises(SaveInputError, match="already staged with other weights"):
        fabric.save(tmp_path / "d.ckpt", {"model": model, "other": other, "iteration": 3})
    io.teardown()


def test_fabric_load_reads_a_path_the_trainer_saved_as_lightnings_file(tmp_path):
    import lightning.pytorch as pl
    from lightning.fabric import Fabric
    from lightning.pytorch.callbacks import ModelCheckpoint

    from stagerd.integrations.lightning import StagerdCheckpointIO

    class Linear(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(4, 2)

        def training_step(self, batch, batch_idx):
            return self.layer(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=0.1)

    module = Linear()
    saves = ModelCheckpoint(dirpath=tmp_path / "ckpts", filename="last")
    trainer = pl.Trainer(max_steps=2, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[saves],
                         plugins=[StagerdCheckpointIO(tmp_path / "root")])  # fmt: skip
    data = torch.utils.data.TensorDataset(torch.arange(16.0).reshape(4, 4) / 16)
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=2))
    trainer.strategy.checkpoint_io.teardown()

    fabric = Fabric(accelerator="cpu", devices=1, plugins=[StagerdCheckpointIO(tmp_path / "root")])
    linear = Linear()
    rest = fabric.load(tmp_path / "ckpts" / "last.ckpt", {"state_dict": linear}, strict=False)
    assert rest["global_step"] == 2 and "optimizer_states" in rest
    assert all(torch.equal(v, module.state_dict()[k]) for k, v in linear.state_dict().items())


@pytest.mark.parametrize("lora", [False, True])
def test_a_compiled_model_given_exports_as_save_pretrained(tmp_path, lora):
    import copy

    from lightning.fabric import Fabric
    from peft import LoraConfig, get_peft_model

    from stagerd.integrations.lightning import StagerdCheckpointIO

    model = fabric_loop.tiny_llama(0)
    if lora:
        model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights=False))
    compiled = torch.compile(model, backend="aot_eager")  # Fabric's state names no `_orig_mod.`
    fabric = Fabric(
        accelerator="cpu", devices=1, plugins=[StagerdCheckpointIO(tmp_path / "root", model=compiled)]
    )
    wrapped, optimizer = fabric.setup(
        compiled, torch.optim.AdamW(p for p in model.parameters() if p.requires_grad)
    )
    fabric.save(tmp_path / "a.ckpt", {"model": wrapped, "optimizer": optimizer, "step": 1})
    fabric.strategy.checkpoint_io.teardown()
    (copy.deepcopy(model).merge_and_unload() if lora else model).save_pretrained(tmp_path / "ref")
    harness.export(tmp_path / "root", tmp_path / "sink")
    harness.assert_same_tensors(tmp_path / "sink" / layout.step_dir_name(1), tmp_path / "ref")
    assert (tmp_path / "sink" / layout.step_dir_name(1) / "adapter").exists() == lora
