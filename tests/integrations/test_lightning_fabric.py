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
