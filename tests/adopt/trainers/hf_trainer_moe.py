"""One rank of a real `transformers.Trainer` run of a tiny Mixtral under Accelerate FSDP2 with
`SHARDED_STATE_DICT` (see hf_trainer.py for the one line that lets Accelerate shard on CPU).

The model's live names are transformers' fused ones (`mlp.experts.gate_up_proj`, one 3D tensor per
layer), and the Trainer's DCP checkpoint `OUT/checkpoint-2/pytorch_model_fsdp_0/` holds them; its
`save_pretrained` writes Mixtral's per-expert names (`block_sparse_moe.experts.E.w1.weight`). Rank 0 then
writes that `save_pretrained` of the gathered trained weights to REF: what the export must equal.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.adopt.trainers import tiny
from tests.fidelity import models
from tests.gloo import join

KIND = "mixtral"


def train(rank: int, world: int, init_file: str, out: str, ref: str, port: int) -> None:
    tiny.rank_env(rank, world, port)
    join(rank, world, init_file)
    import torch
    import transformers as tf
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    torch.manual_seed(0)
    cfg = models.config(KIND)
    model = tf.MixtralForCausalLM(cfg)
    rows = tiny.token_rows(4 * world * tiny.STEPS)
    data: list[dict[str, Any]] = [{"input_ids": r, "labels": r} for r in rows]
    args = tf.TrainingArguments(
        output_dir=out,
        use_cpu=True,
        max_steps=tiny.STEPS,
        save_steps=tiny.STEPS,
        per_device_train_batch_size=4,
        learning_rate=1e-2,
        report_to=[],
        disable_tqdm=True,
        dataloader_num_workers=0,
        fsdp=True,
        fsdp_config={
            "version": 2,
            "state_dict_type": "SHARDED_STATE_DICT",
            "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "transformer_layer_cls_to_wrap": ["MixtralDecoderLayer"],
            "reshard_after_forward": True,
        },
    )
    state = PartialState()
    assert state.distributed_type == DistributedType.MULTI_CPU, state.distributed_type
    state.distributed_type = DistributedType.MULTI_GPU  # see hf_trainer.py
    trainer = tf.Trainer(model=model, args=args, train_dataset=data)
    assert trainer.is_fsdp_enabled and trainer.accelerator.state.fsdp_plugin.fsdp_version == 2
    trainer.train()
    full = get_model_state_dict(
        trainer.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    if rank != 0:
        return
    plain = tf.MixtralForCausalLM(cfg)
    plain.load_state_dict(full)  # strict: every live name of the trained model, none missing
    plain.save_pretrained(Path(ref))
