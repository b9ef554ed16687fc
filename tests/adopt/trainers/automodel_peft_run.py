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
from typing import Any

from tests.adopt.trainers import tiny
from tests.gloo import join

DTYPE = "bfloat16"
RANK, ALPHA = 4, 8


def train(rank: int, world: int, init_file: str, out: str, ref: str, port: int) -> None:
    tiny.rank_env(rank, world, port)
    join(rank, world, init_file)
    import torch
    import transformers as tf
    from nemo_automodel.components._peft.lora import PeftConfig, apply_lora_to_linear_modules
    from nemo_automodel.components.distributed.config import FSDP2Config
    from nemo_automodel.components.distributed.mesh import MeshContext
    from nemo_automodel.components.distributed.model_parallelizer import parallelize_model
    from nemo_automodel.components.models.llama.model import LlamaForCausalLM
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import MixedPrecisionPolicy

    torch.manual_seed(0)
    cfg = tiny.config(dtype=DTYPE)
    model = LlamaForCausalLM(cfg)
    peft = PeftConfig(match_all_linear=True, dim=RANK, alpha=ALPHA, use_memory_efficient_lora=False)
    assert apply_lora_to_linear_modules(model, peft) > 0
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = parallelize_model(model, MeshContext.build(FSDP2Config(mp_policy=policy), world_size=world))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    rows = tiny.token_rows(4 * world * tiny.STEPS).view(tiny.STEPS, world, 4, -1)
    for step in range(tiny.STEPS):
        batch = rows[step, rank]
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    save_as_recipe(out, rank, peft, model, optimizer, loss)

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


def save_as_recipe(out: str, rank: int, peft: Any, model: Any, optimizer: Any, loss: Any) -> None:
    """AutoModel's recipe `save_checkpoint` with a real `Checkpointer(is_peft=True)`, the recipe's tracked
    state as its finetune recipe's `setup` leaves it with a `peft:` section."""
    from nemo_automodel.components.checkpoint.checkpointing import Checkpointer
    from nemo_automodel.components.checkpoint.config import CheckpointingConfig
    from nemo_automodel.components.config.loader import ConfigNode
    from nemo_automodel.components.training.rng import StatefulRNG
    from nemo_automodel.recipes.base_recipe import BaseRecipe

    class Recipe(BaseRecipe):
        """The recipe's tracked state, as its finetune recipe's `setup` leaves it with a `peft:` section."""

    recipe = Recipe()
    recipe.checkpointer = Checkpointer(
        CheckpointingConfig(
            checkpoint_dir=out,
            model_save_format="safetensors",
            save_consolidated=False,
            model_cache_dir=f"{out}.hf_cache",
            is_peft=True,
        ),
        dp_rank=rank,
        tp_rank=0,
        pp_rank=0,
    )
    recipe.peft_config = peft
    recipe.model = model
    recipe.optimizer = optimizer
    recipe.cfg = ConfigNode(
        {"step_scheduler": {"max_steps": tiny.STEPS}, "checkpoint": {"save_consolidated": False}}
    )
    recipe.rng = StatefulRNG(seed=1, ranked=True)
    recipe.save_checkpoint(epoch=0, step=tiny.STEPS, train_loss=loss.detach())
