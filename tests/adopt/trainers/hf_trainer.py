"""One rank of a real `transformers.Trainer` run under Accelerate FSDP2 with `SHARDED_STATE_DICT`.

It writes `OUT/checkpoint-2/pytorch_model_fsdp_0/` (DCP, FileSystemWriter) beside `optimizer_0/`,
`scheduler.pt`, `rng_state_R.pth` and `trainer_state.json`, with the Trainer's own `_save_checkpoint`.
Then Accelerate's own `save_state`, as a loop of the user's calls it, of the same trained model:
`OUT/../accelerate/step-2/` (`pytorch_model_fsdp_0/`, `optimizer_0/`, `random_states_R.pkl`).

CPU: Accelerate enables FSDP only for accelerator distributed types (MULTI_GPU, XPU, ...) and silently
trains plain data-parallel as MULTI_CPU, although FSDP2 (`fully_shard`) itself runs on CPU with gloo.
So the run tells the already-made `PartialState` it is MULTI_GPU before the `Trainer` builds its
`Accelerator`: Accelerate then takes its FSDP2 path; the device stays `cpu`. Everything after that,
sharding, training and every byte of the checkpoint, is the libraries' own code.
"""

from __future__ import annotations

import os
from typing import Any

from tests.adopt.trainers import tiny
from tests.gloo import join


def fsdp_trainer(model: Any, out: str, world: int, layer_cls: str) -> Any:
    """A `transformers.Trainer` of `model` under Accelerate FSDP2 with `SHARDED_STATE_DICT` on CPU, saving
    `OUT/checkpoint-STEPS/` at its last step (see the module docstring for the MULTI_GPU line)."""
    import transformers as tf
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

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
            "transformer_layer_cls_to_wrap": [layer_cls],
            "reshard_after_forward": True,
        },
    )
    state = PartialState()
    assert state.distributed_type == DistributedType.MULTI_CPU, state.distributed_type
    state.distributed_type = DistributedType.MULTI_GPU  # see the module docstring
    trainer = tf.Trainer(model=model, args=args, train_dataset=data)
    assert trainer.is_fsdp_enabled and trainer.accelerator.state.fsdp_plugin.fsdp_version == 2
    return trainer


def train(rank: int, world: int, init_file: str, out: str, ref: str, port: int) -> None:
    tiny.rank_env(rank, world, port)
    join(rank, world, init_file)
    import torch
    import transformers as tf

    torch.manual_seed(0)
    cfg = tiny.config()
    trainer = fsdp_trainer(tf.LlamaForCausalLM(cfg), out, world, "LlamaDecoderLayer")
    trainer.train()
    trainer.accelerator.save_state(os.path.join(os.path.dirname(out), "accelerate", f"step-{tiny.STEPS}"))
    tiny.save_reference(rank, trainer.model, cfg, ref)
