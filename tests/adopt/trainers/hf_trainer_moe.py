"""One rank of a real `transformers.Trainer` run of a tiny Mixtral under Accelerate FSDP2 with
`SHARDED_STATE_DICT` (see hf_trainer.py for the one line that lets Accelerate shard on CPU).

The model's live names are transformers' fused ones (`mlp.experts.gate_up_proj`, one 3D tensor per
layer), and the Trainer's DCP checkpoint `OUT/checkpoint-2/pytorch_model_fsdp_0/` holds them; its
`save_pretrained` writes Mixtral's per-expert names (`block_sparse_moe.experts.E.w1.weight`). Rank 0 then
writes that `save_pretrained` of the gathered trained weights to REF: what the export must equal.
"""

from __future__ import annotations

from pathlib import Path

from tests.adopt.trainers import tiny
from tests.adopt.trainers.hf_trainer import fsdp_trainer
from tests.fidelity import models
from tests.gloo import join

KIND = "mixtral"


def train(rank: int, world: int, init_file: str, out: str, ref: str, port: int) -> None:
    tiny.rank_env(rank, world, port)
    join(rank, world, init_file)
    import torch
    import transformers as tf
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    torch.manual_seed(0)
    cfg = models.config(KIND)
    trainer = fsdp_trainer(tf.MixtralForCausalLM(cfg), out, world, "MixtralDecoderLayer")
    trainer.train()
    full = get_model_state_dict(
        trainer.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    if rank != 0:
        return
    plain = tf.MixtralForCausalLM(cfg)
    plain.load_state_dict(full)  # strict: every live name of the trained model, none missing
    plain.save_pretrained(Path(ref))
