"""A save after `fit` at a step already staged compares the weights with the staged model's, and reads
nothing else: not the optimizer state and Lightning state beside them (their bytes are garbage here, the
headers intact), and the model a bounded run of tensors at a time. One process, a real Lightning Trainer
on CPU, a model with tied weights."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from stagerd.contract import commit_marker, layout
from stagerd.errors import SaveInputError
from stagerd.integrations import lightning_load, step_files
from stagerd.integrations.lightning import StagerdCheckpointIO


class Tied(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 8, bias=False)
        self.b.weight = self.a.weight
        self.c = torch.nn.Linear(8, 8)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        return self.c(self.b(self.a(batch[0]))).pow(2).mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=0.1)


def _fit(tmp_path: Path) -> tuple[Tied, Any]:
    torch.manual_seed(0)
    module = Tied()
    saves = ModelCheckpoint(dirpath=tmp_path / "ckpts", every_n_train_steps=2)
    trainer = pl.Trainer(max_steps=2, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, plugins=[StagerdCheckpointIO(tmp_path / "root")],
                         callbacks=[saves])  # fmt: skip
    data = torch.utils.data.TensorDataset(torch.arange(32.0).reshape(4, 8) / 32)
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=2))
    return module, trainer


def _garble_data(path: Path) -> None:
    """Every byte after the safetensors header set to 0xff: the header (and the file's size) intact."""
    with open(path, "r+b") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        f.seek(8 + n)
        f.write(b"\xff" * (path.stat().st_size - 8 - n))


def test_the_check_reads_no_optimizer_or_lightning_state(tmp_path):
    module, trainer = _fit(tmp_path)
    optim = tmp_path / "root" / layout.step_dir_name(2) / layout.OPTIM_DIR
    shards = sorted(optim.glob("*.safetensors"))
    assert shards
    for shard in shards:
        _garble_data(shard)
    trainer.save_checkpoint(tmp_path / "same.ckpt")  # the weights staged at step 2: the same path
    assert (tmp_path / "same.ckpt").is_file()
    with torch.no_grad():
        module.c.bias.add_(1.0)
    with pytest.raises(SaveInputError, match="step 2 is already staged with other weights"):
        trainer.save_checkpoint(tmp_path / "changed.ckpt")
    assert not (tmp_path / "changed.ckpt").exists()


@pytest.mark.parametrize("chunk", [1, 300, 1 << 30])
def test_the_model_is_compared_a_bounded_run_at_a_time(tmp_path, monkeypatch, chunk):
    """A run never holds more than the bound, beside one tensor larger than it; every change is seen
    whichever run holds it, and a tied key is compared with the one tensor staged for it."""
    module, _ = _fit(tmp_path)
    monkeypatch.setattr(lightning_load, "CHUNK_BYTES", chunk)
    root = tmp_path / "root"
    specs = step_files.model_specs(commit_marker.read_marker(root / layout.step_dir_name(2)))
    assert list(specs) == ["a.weight", "a.bias", "c.weight", "c.bias"]  # b.weight: a.weight's, staged once
    runs = list(lightning_load._chunks(specs))
    assert [n for run in runs for n in run] == list(specs)
    assert len(runs) == {1: 4, 300: 2, 1 << 30: 1}[chunk]  # 256 + 32 bytes, twice
    sizes = [sum(specs[n][0].itemsize * torch.Size(specs[n][1]).numel() for n in run) for run in runs]
    assert all(size <= chunk or len(run) == 1 for size, run in zip(sizes, runs, strict=True))
    state = module.state_dict()
    assert lightning_load.staged_weights_equal(root, 2, state)
    for key, tensor in state.items():  # in place: b.weight stays a.weight's tensor
        before = tensor.clone()
        tensor.view(-1)[-1] += 1
        assert not lightning_load.staged_weights_equal(root, 2, state), key
        tensor.copy_(before)
    assert lightning_load.staged_weights_equal(root, 2, state)
    assert not lightning_load.staged_weights_equal(root, 2, {k: v for k, v in state.items() if k != "c.bias"})
    assert not lightning_load.staged_weights_equal(root, 2, {**state, "c.bias": state["c.bias"].double()})
