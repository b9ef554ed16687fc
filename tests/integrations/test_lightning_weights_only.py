"""Two `ModelCheckpoint`s saving at the same steps through `StagerdCheckpointIO`, one with
`save_weights_only=True` (the best weights, for inference) and one saving everything (to resume from),
in either order: a stagerd step is saved once, so the step must hold the whole checkpoint, and each path
must load back what Lightning's own file there holds. One process, a real Lightning Trainer on CPU, a
linear model with Adam and a scheduler, against the same run with Lightning's own checkpoints."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

ORDERS = ["weights_only_first", "full_first"]


def _module() -> Any:
    import lightning.pytorch as pl

    class Linear(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(4, 2)
            self.losses: dict[int, float] = {}

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            loss = self.layer(batch[0]).pow(2).mean()
            self.losses[self.global_step + 1] = loss.item()
            self.log("score", loss)
            return loss

        def configure_optimizers(self) -> Any:
            opt = torch.optim.Adam(self.parameters(), lr=0.1)
            return [opt], [{"scheduler": torch.optim.lr_scheduler.StepLR(opt, 1, 0.5), "interval": "step"}]

    return Linear()


def _fit(out: Path, staged: bool, order: str, seed: int, ckpt_path: str | None, steps: int) -> Any:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    from stagerd.integrations.lightning import StagerdCheckpointIO

    torch.manual_seed(seed)
    module = _module()
    weights = ModelCheckpoint(dirpath=out / "weights", monitor="score", every_n_train_steps=2,
                              save_weights_only=True, filename="best")  # fmt: skip
    full = ModelCheckpoint(dirpath=out / "full", every_n_train_steps=2, filename="{step}")
    callbacks = [weights, full] if order == "weights_only_first" else [full, weights]
    plugins = [StagerdCheckpointIO(out / "root", model=module)] if staged else []
    trainer = pl.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
                         plugins=plugins)  # fmt: skip
    data = torch.utils.data.TensorDataset(torch.arange(32.0).reshape(8, 4) / 32)
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=2), ckpt_path=ckpt_path)
    return module


@pytest.mark.parametrize("order", ORDERS)
def test_a_full_checkpoint_at_a_weights_only_step_resumes_as_lightnings_own(tmp_path, order):
    results = {}
    for staged in (False, True):
        out = tmp_path / ("staged" if staged else "plain")
        _fit(out, staged, order, seed=0, ckpt_path=None, steps=2)
        resumed = _fit(out, staged, order, seed=1, ckpt_path=str(out / "full" / "step=2.ckpt"), steps=4)
        results[staged] = resumed.losses, resumed.state_dict()
    (plain_losses, plain_weights), (losses, weights) = results[False], results[True]
    assert list(losses) == [3, 4]
    assert losses == plain_losses
    assert all(torch.equal(weights[k], plain_weights[k]) for k in plain_weights)


@pytest.mark.parametrize("order", ORDERS)
def test_each_path_loads_what_lightnings_file_there_holds(tmp_path, order):
    from stagerd.integrations.lightning import StagerdCheckpointIO

    for staged in (False, True):
        _fit(tmp_path / ("staged" if staged else "plain"), staged, order, seed=0, ckpt_path=None, steps=2)
    io = StagerdCheckpointIO(tmp_path / "staged" / "root")
    for path in ("weights/best.ckpt", "full/step=2.ckpt"):
        own = torch.load(tmp_path / "plain" / path, weights_only=False)
        loaded = io.load_checkpoint(tmp_path / "staged" / path)
        assert sorted(loaded) == sorted(own), path
        assert all(torch.equal(loaded["state_dict"][k], v) for k, v in own["state_dict"].items())


def test_a_full_save_of_a_step_staged_weights_only_is_refused_by_name(tmp_path):
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    from stagerd.errors import SaveInputError
    from stagerd.integrations.lightning import StagerdCheckpointIO

    module = _module()
    weights = ModelCheckpoint(dirpath=tmp_path / "weights", every_n_train_steps=2, save_weights_only=True)
    trainer = pl.Trainer(max_steps=2, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[weights],
                         plugins=[StagerdCheckpointIO(tmp_path / "root")])  # fmt: skip
    data = torch.utils.data.TensorDataset(torch.arange(16.0).reshape(4, 4) / 16)
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=2))
    with pytest.raises(SaveInputError, match="step 2 was staged from a weights-only checkpoint"):
        trainer.save_checkpoint(tmp_path / "full.ckpt")  # the same step, which holds no optimizer state
    assert not (tmp_path / "full.ckpt").exists()  # no path that would load without it
