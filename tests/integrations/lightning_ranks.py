"""What each gloo rank of the Lightning test does: a tiny Llama in a LightningModule, DDP on 2 ranks, 2
epochs of 2 steps, `ModelCheckpoint` at every epoch end (and `last`) through `StagerdCheckpointIO`.

- `full/`: uninterrupted; rank 0 writes `save_pretrained` of the weights at every save (`ref/step-N/`);
- `resumed/`: a module from another seed, `fit(ckpt_path=<the step-2 checkpoint path>)`, which names a
  step of `full/`'s ROOT, and goes on to step 4 under a ROOT of its own.
Lightning saves no RNG state, so the model has no dropout. Rank 0 writes `result.json`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl

from tests.fidelity import models
from tests.gloo import join

EPOCHS, SAMPLES, SEQ = 2, 8, 12


class TinyLM(pl.LightningModule):
    def __init__(self, seed: int, lr: float = 1e-2) -> None:
        import torch
        import transformers as tf

        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(seed)
        self.model = tf.AutoModelForCausalLM.from_config(models.config("llama_tied"))
        self.losses: dict[int, float] = {}

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        (ids,) = batch
        loss = self.model(input_ids=ids, labels=ids).loss
        self.losses[self.global_step + 1] = loss.item()
        return loss

    def configure_optimizers(self) -> Any:
        import torch

        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
        return [opt], [{"scheduler": sched, "interval": "step"}]


class Attached(pl.Callback):
    """Whether the strategy's optimizer waits for the copy (on rank 0, the one that saves), late in fit."""

    attached = False

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        hooks = trainer.strategy.optimizers[0]._optimizer_step_pre_hooks.values()
        self.attached = any(h.__module__ == "stagerd.training.optimizer_hook" for h in hooks)


class Reference(pl.Callback):
    def __init__(self, out: Path) -> None:
        self.out = out

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: Any) -> None:
        if trainer.is_global_zero:
            pl_module.model.save_pretrained(self.out / f"step-{trainer.global_step}")


def fit(out: Path, name: str, seed: int, ckpt_path: str | None) -> TinyLM:
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint

    from stagerd.integrations.lightning import StagerdCheckpointIO

    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, models.VOCAB, (SAMPLES, SEQ), generator=g)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=2)
    module = TinyLM(seed)
    callbacks: list[Any] = [ModelCheckpoint(dirpath=out / name / "ckpts", save_top_k=-1, save_last=True)]
    callbacks.append(attached := Attached())
    if ckpt_path is None:
        callbacks.append(Reference(out / "ref"))
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", max_epochs=EPOCHS, logger=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        plugins=[StagerdCheckpointIO(out / name / "root", model=module)], callbacks=callbacks,
    )  # fmt: skip
    trainer.fit(module, data, ckpt_path=ckpt_path)
    module.attached = attached.attached
    return module


def run(rank: int, world: int, init_file: str, out_dir: str) -> None:
    env = dict(RANK=rank, LOCAL_RANK=rank, GROUP_RANK=0, WORLD_SIZE=world, LOCAL_WORLD_SIZE=world)
    os.environ.update({k: str(v) for k, v in env.items()}, TORCHELASTIC_RUN_ID="stagerd-test")
    join(rank, world, init_file)  # Lightning finds the process group made and the torchelastic world
    out = Path(out_dir)
    full = fit(out, "full", seed=0, ckpt_path=None)
    resumed = fit(out, "resumed", seed=1, ckpt_path=str(out / "full" / "ckpts" / "epoch=0-step=2.ckpt"))
    sa, sb = full.model.state_dict(), resumed.model.state_dict()
    import torch

    same = sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    if rank == 0:
        result = {"full": full.losses, "resumed": resumed.losses, "same_weights": same,
                  "attached": [full.attached, resumed.attached]}  # fmt: skip
        (out / "result.json").write_text(json.dumps(result))
