"""One rank of a real `transformers.Trainer` run of a PEFT LoRA model (`lora` false: the model itself)
under Accelerate FSDP2 (2 gloo CPU ranks; see hf_trainer.py for the one line that lets Accelerate shard on
CPU), with the `state_dict_type` given. `SHARDED_STATE_DICT`: `checkpoint-2/pytorch_model_fsdp_0/` is a
DCP save of the adapter alone (`adapter_only`), and no adapter_config.json is written. `FULL_STATE_DICT`:
`PeftModel.save_pretrained`'s `adapter_model.safetensors` and `adapter_config.json` (without LoRA,
`save_pretrained`'s `model.safetensors`), beside `pytorch_model_fsdp.bin`."""

from __future__ import annotations

from typing import Any

from tests.adopt.trainers import tiny
from tests.gloo import join

LORA_SEED = 0  # the base model is LlamaForCausalLM(tiny.config()) made right after this seed


def train(
    rank: int, world: int, init_file: str, out: str, state_dict_type: str, lora: bool, port: int
) -> None:
    tiny.rank_env(rank, world, port)
    join(rank, world, init_file)
    import torch
    import transformers as tf
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(LORA_SEED)
    model = tf.LlamaForCausalLM(tiny.config())
    if lora:
        model = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    data: list[dict[str, Any]] = [
        {"input_ids": r, "labels": r} for r in tiny.token_rows(4 * world * tiny.STEPS)
    ]
    args = tf.TrainingArguments(
        output_dir=out, use_cpu=True, max_steps=tiny.STEPS, save_steps=tiny.STEPS,
        per_device_train_batch_size=4, learning_rate=5e-2, report_to=[], disable_tqdm=True,
        dataloader_num_workers=0, fsdp=True,
        fsdp_config={
            "version": 2, "state_dict_type": state_dict_type, "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"], "reshard_after_forward": True,
        },
    )  # fmt: skip
    state = PartialState()
    state.distributed_type = DistributedType.MULTI_GPU  # see hf_trainer.py
    tf.Trainer(model=model, args=args, train_dataset=data).train()
