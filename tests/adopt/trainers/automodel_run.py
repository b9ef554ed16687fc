"""One rank of NeMo AutoModel 0.7's own model, sharding and checkpoint code, driven in-process.

AutoModel's training recipe cannot run on CPU: `NeMoAutoModelForCausalLM.from_config` and the finetune
recipe call `torch.cuda.current_device()` / `torch.cuda.reset_peak_memory_stats()` unconditionally.
So this drives its own pieces, as its recipe does, in-process: the registry's Llama class
(`components.models.llama.model.LlamaForCausalLM`) in bf16 (AutoModel's default dtype), its FSDP2
`MeshContext.build` + `parallelize_model` (a CPU mesh on gloo), two optimizer steps, then the recipe's
real `BaseRecipe.save_checkpoint` with a real `Checkpointer(save_consolidated=False)`. Nothing of its
layout is re-created here: `OUT/epoch_0_step_2/` (`model/` HuggingFaceStorageWriter shards and
`.hf_metadata/`, `optim/`, `rng/`, `losses.json`, `config.yaml`, the `.incomplete` marker removed last)
and `OUT/LATEST` are AutoModel's. Then the same state saved again with `model_save_format: torch_save`
into `OUT-torch_save/` (`model/` a FileSystemWriter save: `.metadata`, `__R_0.distcp`).
"""

from __future__ import annotations

from tests.adopt.trainers import tiny
from tests.gloo import join

DTYPE = "bfloat16"


def train(rank: int, world: int, init_file: str, out: str, ref: str, port: int) -> None:
    tiny.rank_env(rank, world, port)
    join(rank, world, init_file)
    import torch
    from nemo_automodel.components.checkpoint.checkpointing import Checkpointer
    from nemo_automodel.components.checkpoint.config import CheckpointingConfig
    from nemo_automodel.components.config.loader import ConfigNode
    from nemo_automodel.components.distributed.config import FSDP2Config
    from nemo_automodel.components.distributed.mesh import MeshContext
    from nemo_automodel.components.distributed.model_parallelizer import parallelize_model
    from nemo_automodel.components.models.llama.model import LlamaForCausalLM
    from nemo_automodel.components.training.rng import StatefulRNG
    from nemo_automodel.recipes.base_recipe import BaseRecipe
    from torch.distributed.fsdp import MixedPrecisionPolicy

    torch.manual_seed(0)
    cfg = tiny.config(tied=True, dtype=DTYPE)
    model = LlamaForCausalLM(cfg)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    mesh = MeshContext.build(FSDP2Config(mp_policy=policy), world_size=world)
    model = parallelize_model(model, mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rows = tiny.token_rows(4 * world * tiny.STEPS).view(tiny.STEPS, world, 4, -1)
    for step in range(tiny.STEPS):
        batch = rows[step, rank]
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    class Recipe(BaseRecipe):
        """The recipe's tracked state, as `TrainFinetuneRecipeForNextTokenPrediction.setup` leaves it."""

    recipe = Recipe()
    recipe.checkpointer = Checkpointer(
        CheckpointingConfig(
            checkpoint_dir=out,
            model_save_format="safetensors",
            save_consolidated=False,
            model_cache_dir=f"{out}.hf_cache",  # only read when loading a base model
        ),
        dp_rank=rank,
        tp_rank=0,
        pp_rank=0,
    )
    recipe.peft_config = None
    recipe.model = model
    recipe.optimizer = optimizer
    recipe.cfg = ConfigNode(
        {"step_scheduler": {"max_steps": tiny.STEPS}, "checkpoint": {"save_consolidated": False}}
    )
    recipe.rng = StatefulRNG(seed=1, ranked=True)
    recipe.save_checkpoint(epoch=0, step=tiny.STEPS, train_loss=loss.detach())
    # the same state with `model_save_format: torch_save` (`model/` a FileSystemWriter save), beside it
    recipe.checkpointer = Checkpointer(
        CheckpointingConfig(
            checkpoint_dir=f"{out}-torch_save",
            model_save_format="torch_save",
            save_consolidated=False,
            model_cache_dir=f"{out}.hf_cache",
        ),
        dp_rank=rank,
        tp_rank=0,
        pp_rank=0,
    )
    recipe.save_checkpoint(epoch=0, step=tiny.STEPS, train_loss=loss.detach())
    tiny.save_reference(rank, model, cfg, ref, DTYPE)
