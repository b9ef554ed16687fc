"""`StagerdCheckpointIO` handed to Lightning Fabric (`Fabric(plugins=[io])`): Fabric accepts any
`CheckpointIO`, but its `fabric.save(path, state)` gives a state of the user's own making (no
`global_step`, no LightningModule), which the plugin cannot stage. The save is refused by name, with the
way to save from a Fabric loop, before anything is written. Real Fabric, one CPU process."""

from __future__ import annotations

import pytest
import torch

from stagerd.errors import ConfigError


def test_a_fabric_save_is_refused_by_name_before_anything_is_written(tmp_path):
    from lightning.fabric import Fabric

    from stagerd.integrations.lightning import StagerdCheckpointIO

    io = StagerdCheckpointIO(tmp_path / "root")
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[io])
    linear = torch.nn.Linear(4, 2)
    model, optimizer = fabric.setup(linear, torch.optim.Adam(linear.parameters()))
    with pytest.raises(ConfigError, match="Fabric") as e:
        fabric.save(tmp_path / "ckpt", {"model": model, "optimizer": optimizer, "step": 3})
    assert "Stager" in (e.value.hint or "")
    assert not (tmp_path / "ckpt").exists()
    assert not (tmp_path / "root").exists()


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
