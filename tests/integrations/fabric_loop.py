"""A Lightning Fabric loop saving and resuming through `StagerdCheckpointIO`, the loop as Fabric's docs
write it (`fabric.save(path, {"model": model, "optimizer": optimizer, "step": step})`, `fabric.load(path,
state)`): one process (`fit`) or 2 gloo ranks under DDP (`run`, for `tests.gloo.launch`)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

STEPS, SAVE_AT = 4, 2


def tiny_llama(seed: int) -> Any:
    import transformers as tf

    torch.manual_seed(seed)
    config = tf.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                            num_attention_heads=2, num_key_value_heads=1)  # fmt: skip
    return tf.AutoModelForCausalLM.from_config(config)


def fit(out: Path, root: Path, resume: Path | None, devices: int = 1, strategy: str = "auto") -> Any:
    """Train STEPS steps (from the step saved at `resume`, if given), saving at SAVE_AT and STEPS; the
    losses by step and the final weights."""
    from lightning.fabric import Fabric

    from stagerd.integrations.lightning import StagerdCheckpointIO

    hf = tiny_llama(seed=0 if resume is None else 1)  # a resumed run's own init must not matter
    fabric = Fabric(accelerator="cpu", devices=devices, strategy=strategy,
                    plugins=[StagerdCheckpointIO(root, model=hf)])  # fmt: skip
    fabric.launch()  # under DDP: joins the process group the ranks made
    model, optimizer = fabric.setup(hf, torch.optim.AdamW(hf.parameters(), lr=1e-2))
    state: dict[str, Any] = {"model": model, "optimizer": optimizer, "step": 0, "note": "run"}
    if resume is not None:
        fabric.load(resume, state)
    batches = torch.randint(0, 64, (STEPS, 2, 8), generator=torch.Generator().manual_seed(2))
    losses = {}
    while state["step"] < STEPS:
        batch = batches[state["step"]][fabric.global_rank :: fabric.world_size]
        loss = model(input_ids=batch, labels=batch).loss
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        state["step"] += 1
        losses[state["step"]] = loss.item()
        if state["step"] in (SAVE_AT, STEPS):
            fabric.save(out / f"step-{state['step']}.ckpt", state)
    fabric.strategy.checkpoint_io.teardown()
    return losses, {k: v.detach().clone() for k, v in hf.state_dict().items()}


def run(rank: int, world: int, init_file: str, out_dir: str) -> None:
    from tests.gloo import join

    env = dict(RANK=rank, LOCAL_RANK=rank, GROUP_RANK=0, WORLD_SIZE=world, LOCAL_WORLD_SIZE=world)
    os.environ.update({k: str(v) for k, v in env.items()}, TORCHELASTIC_RUN_ID="stagerd-test")
    join(rank, world, init_file)  # Fabric finds the process group made and the torchelastic world
    out = Path(out_dir)
    full = fit(out / "full", out / "full" / "root", None, devices=world, strategy="ddp")
    resumed = fit(out / "resumed", out / "resumed" / "root", out / "full" / f"step-{SAVE_AT}.ckpt",
                  devices=world, strategy="ddp")  # fmt: skip
    same = all(torch.equal(v, resumed[1][k]) for k, v in full[1].items())
    if rank == 0:
        result = {"full": full[0], "resumed": resumed[0], "same_weights": same}
        (out / "result.json").write_text(json.dumps(result))
