"""The first run of a script that resumes Lightning from ROOT (`fit(ckpt_path=ROOT)` before any step is
committed there): the error says to pass ckpt_path=None, and that run then saves steps a second fit
resumes from (one process, a real Trainer and plugin)."""

from __future__ import annotations

import pytest
import torch

from stagerd.contract import layout
from stagerd.errors import LoadError


def _module():
    import lightning as L

    class Lit(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.layer = torch.nn.Linear(4, 2)

        def training_step(self, batch, batch_idx):
            return self.layer(batch).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(torch.randn(4, 4), batch_size=2)

    return Lit()


def _fit(root, out, epochs, ckpt_path):
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    from stagerd.integrations.lightning import StagerdCheckpointIO

    module = _module()
    io = StagerdCheckpointIO(root, model=module)
    trainer = L.Trainer(
        plugins=[io], callbacks=[ModelCheckpoint()], max_epochs=epochs, accelerator="cpu", logger=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=out,
    )  # fmt: skip
    trainer.fit(module, ckpt_path=ckpt_path)
    io.teardown()
    return trainer


@pytest.mark.parametrize("made", [False, True], ids=["absent", "empty"])
def test_resuming_from_a_root_with_no_step_says_to_pass_none(tmp_path, made):
    root = tmp_path / "root"
    if made:
        root.mkdir()
        (root / ".stagerd").mkdir()
    with pytest.raises(LoadError, match=r"nothing to load \(Trainer.fit: pass ckpt_path=None\)"):
        _fit(root, tmp_path / "out", 1, str(root))
    trainer = _fit(root, tmp_path / "out", 1, None)
    assert [s for s, _ in layout.committed_steps(root)] == [2]
    trainer = _fit(root, tmp_path / "out2", 2, str(root))
    assert trainer.global_step == 4
    assert [s for s, _ in layout.committed_steps(root)] == [2, 4]


def test_a_folder_of_other_files_is_still_no_stagerd_checkpoint(tmp_path):
    from stagerd.integrations.lightning import load_from_checkpoint

    (tmp_path / "epoch=0-step=2.ckpt").write_bytes(b"not ours")
    with pytest.raises(LoadError, match="not a stagerd checkpoint"):
        load_from_checkpoint(type(_module()), tmp_path)


def test_a_typod_root_names_the_sibling_meant(tmp_path):
    from stagerd.integrations.lightning import load_from_checkpoint

    (tmp_path / "ckpt").mkdir()
    with pytest.raises(LoadError, match=f"does not exist; did you mean {tmp_path / 'ckpt'}\\?: a fresh run"):
        load_from_checkpoint(type(_module()), tmp_path / "ckpy")
