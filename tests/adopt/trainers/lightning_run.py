"""One rank of a real Lightning 2.6 run with `ModelParallelStrategy` (FSDP2) on CPU, as it comes.

Its default `ModelCheckpoint` writes `OUT/checkpoints/epoch=0-step=2.ckpt/`, a DCP directory
(`__R_0.distcp`, `.metadata`, then rank 0's `meta.pt`) holding the model under `state_dict.model.` and
the optimizer under `optimizer_0.`. The model ties its embeddings, so the checkpoint holds both
`...embed_tokens.weight` and `...lm_head.weight` while `save_pretrained` writes only the first.
"""

from __future__ import annotations

from typing import Any

from tests.adopt.trainers import tiny
from tests.gloo import join


def _module(cfg: Any) -> Any:
    import lightning as L
    import torch
    import transformers as tf
    from torch.distributed.fsdp import fully_shard

    class TinyLlama(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.model = tf.LlamaForCausalLM(cfg)

        def configure_model(self) -> None:
            mesh = self.device_mesh["data_parallel"]
            for layer in self.model.model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(self.model, mesh=mesh)

        def training_step(self, batch: Any, _: int) -> Any:
            return self.model(input_ids=batch, labels=batch).loss

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    return TinyLlama()


def train(rank: int, world: int, init_file: str, out: str, ref: str, port: int) -> None:
    tiny.rank_env(rank, world, port)
    join(rank, world, init_file)
    import lightning as L
    import torch
    from lightning.pytorch.strategies import ModelParallelStrategy

    cfg = tiny.config(tied=True)
    module = _module(cfg)
    rows = tiny.token_rows(4 * world * tiny.STEPS)
    loader = torch.utils.data.DataLoader(list(rows), batch_size=4)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1),
        max_steps=tiny.STEPS,
        default_root_dir=out,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, loader)
    tiny.save_reference(rank, module.model, cfg, ref)
