"""`StagerdCheckpointIO` and a LightningModule's hyper-parameters, which every checkpoint holds as JSON:
one JSON cannot hold (a transformers config given to `save_hyperparameters()`, as many modules do) is
refused when the plugin is made, naming it, rather than at the first save after every step before it;
left out with `save_hyperparameters(ignore=...)`, the run saves."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from stagerd.contract import layout
from stagerd.errors import SaveInputError
from stagerd.integrations.lightning import StagerdCheckpointIO
from tests.fidelity import models


class ConfigLM(pl.LightningModule):
    def __init__(self, config: Any, lr: float = 1e-2, ignore: tuple[str, ...] = ()) -> None:
        import transformers as tf

        super().__init__()
        self.save_hyperparameters(ignore=list(ignore))
        self.model = tf.AutoModelForCausalLM.from_config(config)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        (ids,) = batch
        return self.model(input_ids=ids, labels=ids).loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


def test_a_config_among_the_hyper_parameters_is_refused_before_training(tmp_path):
    module = ConfigLM(models.config("llama"))
    with pytest.raises(SaveInputError, match=r"lightning/hyper_parameters/config: a .*LlamaConfig") as e:
        StagerdCheckpointIO(tmp_path / "root", model=module)
    assert "save_hyperparameters(ignore=" in e.value.hint


def test_left_out_the_run_saves(tmp_path):
    module = ConfigLM(models.config("llama"), ignore=("config",))
    io = StagerdCheckpointIO(tmp_path / "root", model=module)
    ids = torch.randint(0, models.VOCAB, (4, 12), generator=torch.Generator().manual_seed(1))
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=2)
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=2, logger=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=tmp_path, plugins=[io],
    )  # fmt: skip
    trainer.fit(module, data)
    assert [s for s, _ in layout.committed_steps(tmp_path / "root")] == [2]
