"""Saves through `StagerdCheckpointIO` after which the parameters change in place before any optimizer step
(which is what waits for the save's host copy otherwise): Lightning's `EMAWeightAveraging` swaps the
averaged weights in for validation and copies them in when training ends, and a `trainer.save_checkpoint`
after `fit` may be followed by anything. Each step must hold the values of its save, as Lightning's own
files do. One process, a real Lightning Trainer on CPU, a model of 24 MiB (a copy that takes a while)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

WIDTH, LAYERS = 1024, 6


def _module() -> Any:
    import lightning.pytorch as pl

    class Wide(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.layers = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            return self.layers(batch[0]).pow(2).mean()

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            self.log("val", self.layers(batch[0]).pow(2).mean())

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=1e-3)

    return Wide()


def _data() -> Any:
    data = torch.randn(16, WIDTH, generator=torch.Generator().manual_seed(1))
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data), batch_size=4)


def _trainer(plugins: list[Any], callbacks: list[Any], **kwargs: Any) -> Any:
    import lightning.pytorch as pl

    return pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, plugins=plugins, callbacks=callbacks,
                      **kwargs)  # fmt: skip


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_steps_saved_before_ema_swaps_the_weights_hold_the_saved_values(tmp_path):
    """A save at a training step's end, validation right after it (swapping the averaged weights in and
    back), and the last save right before the averaged weights are copied in at the end of training."""
    from lightning.pytorch.callbacks import EMAWeightAveraging, ModelCheckpoint

    from stagerd.integrations.lightning import StagerdCheckpointIO

    ios: dict[str, Any] = {}
    for name in ("plain", "staged"):
        module = _module()
        ios[name] = io = StagerdCheckpointIO(tmp_path / name / "root", model=module)
        saves = ModelCheckpoint(
            dirpath=tmp_path / name, every_n_train_steps=2, save_top_k=-1, filename="{step}"
        )
        trainer = _trainer([io] if name == "staged" else [], [EMAWeightAveraging(decay=0.5), saves],
                           max_steps=4, val_check_interval=2, num_sanity_val_steps=0)  # fmt: skip
        trainer.fit(module, _data(), _data())
    for step in (2, 4):
        own = torch.load(tmp_path / "plain" / f"step={step}.ckpt", weights_only=False)
        staged = ios["staged"].load_checkpoint(tmp_path / "staged" / f"step={step}.ckpt")
        for key in ("state_dict", "current_model_state"):  # the averaged weights, the trained ones
            assert _same(staged[key], own[key]), (step, key)


def test_a_save_after_fit_holds_the_weights_of_its_call(tmp_path: Path):
    from stagerd.integrations.lightning import StagerdCheckpointIO

    module = _module()
    io = StagerdCheckpointIO(tmp_path / "root", model=module)
    trainer = _trainer([io], [], max_steps=2, enable_checkpointing=False)
    trainer.fit(module, _data())
    saved = {k: v.clone() for k, v in module.state_dict().items()}
    trainer.save_checkpoint(tmp_path / "final.ckpt")
    with torch.no_grad():
        for p in module.parameters():
            p.add_(1.0)  # after training: a merge, a quantization, another fine-tune's start
    assert _same(io.load_checkpoint(tmp_path / "final.ckpt")["state_dict"], saved)


def test_a_step_saved_before_a_schedule_free_switch_holds_the_saved_values(tmp_path):
    """A schedule-free optimizer switched to eval mode for validation (in the module's hooks, as
    schedule-free tells Lightning users to), right after a save at a training step's end."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    from stagerd.integrations.lightning import StagerdCheckpointIO
    from tests.integrations.schedule_free import ScheduleFreeSGD

    class Switched(type(_module())):  # type: ignore[misc]
        def configure_optimizers(self) -> Any:
            return ScheduleFreeSGD(self.parameters(), lr=1e-3)

        def on_validation_epoch_start(self) -> None:
            self.optimizers().optimizer.eval()

        def on_validation_epoch_end(self) -> None:
            self.optimizers().optimizer.train()

    assert issubclass(Switched, pl.LightningModule)
    ios: dict[str, Any] = {}
    for name in ("plain", "staged"):
        module = Switched()
        ios[name] = io = StagerdCheckpointIO(tmp_path / name / "root", model=module)
        saves = ModelCheckpoint(
            dirpath=tmp_path / name, every_n_train_steps=2, save_top_k=-1, filename="{step}"
        )
        trainer = _trainer([io] if name == "staged" else [], [saves], max_steps=4, val_check_interval=2,
                           num_sanity_val_steps=0)  # fmt: skip
        trainer.fit(module, _data(), _data())
    for step in (2, 4):
        own = torch.load(tmp_path / "plain" / f"step={step}.ckpt", weights_only=False)
        staged = ios["staged"].load_checkpoint(tmp_path / "staged" / f"step={step}.ckpt")
        assert _same(staged["state_dict"], own["state_dict"]), step


def test_a_save_after_fit_of_changed_weights_at_a_staged_step_is_refused_by_name(tmp_path):
    """`ModelCheckpoint` staged the last step; after `fit` the weights change (a merge, a rescale) and are
    saved again at the same global step, which cannot be staged twice: refused, not a path that loads the
    weights of before. Unchanged, the second path names the staged step."""
    import pytest
    from lightning.pytorch.callbacks import ModelCheckpoint

    from stagerd.errors import SaveInputError
    from stagerd.integrations.lightning import StagerdCheckpointIO

    module = _module()
    io = StagerdCheckpointIO(tmp_path / "root", model=module)
    trainer = _trainer(
        [io], [ModelCheckpoint(dirpath=tmp_path / "ckpts", every_n_train_steps=2)], max_steps=2
    )
    trainer.fit(module, _data())
    trainer.save_checkpoint(tmp_path / "final.ckpt")  # the weights ModelCheckpoint staged at step 2
    assert _same(io.load_checkpoint(tmp_path / "final.ckpt")["state_dict"], module.state_dict())
    with torch.no_grad():
        module.layers[0].weight.mul_(0.5)
    with pytest.raises(SaveInputError, match="step 2 is already staged with other weights"):
        trainer.save_checkpoint(tmp_path / "changed.ckpt")
    assert not (tmp_path / "changed.ckpt").exists()
