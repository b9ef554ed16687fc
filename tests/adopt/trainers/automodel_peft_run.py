"""One rank of NeMo AutoModel 0.7 training LoRA adapters (`is_peft`), driven in-process as in
automodel_run.py (its recipe needs CUDA): its Llama with its own `apply_lora_to_linear_modules` (every
linear layer), its FSDP2 on a CPU gloo mesh, two optimizer steps, then the recipe's `save_checkpoint` with
a real `Checkpointer(is_peft=True)`. AutoModel writes `OUT/epoch_0_step_2/model/adapter_model.safetensors`
(PEFT's names), `adapter_config.json` and `automodel_peft_config.json` there, no `.hf_metadata/`, and
removes `.incomplete` last. Rank 0 writes the reference: the base weights as `save_pretrained` writes them
(`REF/base/`), and the trained LoRA factors by AutoModel's module names (`REF/lora.safetensors`).
"""

from __future__ import annotations

from pathlib import Path

from tests.adopt.trainers import tiny
from tests.adopt.trainers.automodel_recipe import fit, save_as_recipe
from tests.gloo import join

DTYPE = "bfloat16"
RANK, ALPHA = 4, 8


def train(rank: int, world: int, init_file: str, out: str, ref: str, port: int) -> None:
    tiny.rank_env(rank, world, port)
    join(rank, world, init_file)
    import torch
    import transformers as tf
    from nemo_automodel.components._peft.lora import PeftConfig, apply_lora_to_linear_modules
    from nemo_automodel.components.models.llama.model import LlamaForCausalLM
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    torch.manual_seed(0)
    cfg = tiny.config(dtype=DTYPE)
    model = LlamaForCausalLM(cfg)
    peft = PeftConfig(match_all_linear=True, dim=RANK, alpha=ALPHA, use_memory_efficient_lora=False)
    assert apply_lora_to_linear_modules(model, peft) > 0
    model, optimizer, loss = fit(model, rank, world)
    save_as_recipe(out, rank, model, optimizer, loss, peft=peft)

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank != 0:
        return
    lora = {k: v.contiguous() for k, v in full.items() if ".lora_" in k}
    Path(ref).mkdir(parents=True, exist_ok=True)
    save_file(lora, str(Path(ref) / "lora.safetensors"))
    base = tf.LlamaForCausalLM(cfg).to(getattr(torch, DTYPE))
    missing, unexpected = base.load_state_dict({k: v for k, v in full.items() if k not in lora}, strict=False)
    assert not unexpected and not missing, (missing, unexpected)
    base.save_pretrained(Path(ref) / "base")
