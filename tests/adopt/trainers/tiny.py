"""What the three trainer runs share: the tiny Llama, its data, the rank's environment, and the reference
every export is compared with (`save_pretrained` of the trained weights, gathered after training)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from tests.fidelity import models
from tests.fidelity.models import VOCAB

STEPS = 2


def config(*, tied: bool = False, dtype: str = "float32") -> Any:
    return models.config("llama_tied" if tied else "llama", dtype=dtype)


def token_rows(n: int, seed: int = 1) -> Any:
    """`n` rows of 16 token ids, the same on every rank (the trainers' samplers split them)."""
    import torch

    return torch.randint(0, VOCAB, (n, 16), generator=torch.Generator().manual_seed(seed))


def rank_env(rank: int, world: int, port: int) -> None:
    """What torchrun would set: the trainers read it to find their place (the gloo group is already up,
    so none of them opens another rendezvous)."""
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        NODE_RANK="0",
        GROUP_RANK="0",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
    )


def save_reference(rank: int, model: Any, cfg: Any, ref: str, dtype: str = "float32") -> None:
    """Gather the trained (sharded) model on every rank, then rank 0 loads it into a plain transformers
    model of the same config and writes `save_pretrained` to `ref/`: what the export must equal."""
    import torch
    import transformers as tf
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank != 0:
        return
    plain = tf.LlamaForCausalLM(cfg).to(getattr(torch, dtype))
    missing, unexpected = plain.load_state_dict(full, strict=False)
    # A tied lm_head is absent from the gathered dict only where the trainer dropped it itself.
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    plain.save_pretrained(Path(ref))


def write_extras(cfg: Any, extras: Path) -> None:
    """config.json and generation_config.json, as a user keeps them beside their checkpoints."""
    import transformers as tf

    extras.mkdir(parents=True, exist_ok=True)
    cfg.save_pretrained(extras)
    tf.GenerationConfig.from_model_config(cfg).save_pretrained(extras)
