"""What the AutoModel runs share, as its recipe does it: FSDP2 on a CPU gloo mesh, a few AdamW steps, and
the recipe's real `BaseRecipe.save_checkpoint` through a real `Checkpointer`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tests.adopt.trainers import tiny


def fit(
    model: Any, rank: int, world: int, loss_of: Callable[[Any, Any], Any] | None = None
) -> tuple[Any, Any, Any]:
    """`model` sharded with AutoModel's FSDP2 (bf16 compute, fp32 reduce), trained `tiny.STEPS` steps on
    this rank's rows: (the sharded model, its optimizer, the last loss). `loss_of(model, batch)`: the
    loss, by default the model's own from `labels=`."""
    import torch
    from nemo_automodel.components.distributed.config import FSDP2Config
    from nemo_automodel.components.distributed.mesh import MeshContext
    from nemo_automodel.components.distributed.model_parallelizer import parallelize_model
    from torch.distributed.fsdp import MixedPrecisionPolicy

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = parallelize_model(model, MeshContext.build(FSDP2Config(mp_policy=policy), world_size=world))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    rows = tiny.token_rows(4 * world * tiny.STEPS).view(tiny.STEPS, world, 4, -1)
    loss = None
    for step in range(tiny.STEPS):
        batch = rows[step, rank]
        loss = model(input_ids=batch, labels=batch).loss if loss_of is None else loss_of(model, batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer, loss


def save_as_recipe(
    out: str,
    rank: int,
    model: Any,
    optimizer: Any,
    loss: Any,
    *,
    peft: Any = None,
    model_save_format: str = "safetensors",
    cache: str | None = None,
) -> None:
    """The recipe's `save_checkpoint` into `out`, its tracked state as its finetune recipe's `setup` leaves
    it (with a `peft:` section when `peft` is given: `Checkpointer(is_peft=True)`). `cache`: the base
    model's cache directory, only read when loading one (default `OUT.hf_cache`)."""
    from nemo_automodel.components.checkpoint.checkpointing import Checkpointer
    from nemo_automodel.components.checkpoint.config import CheckpointingConfig
    from nemo_automodel.components.config.loader import ConfigNode
    from nemo_automodel.components.training.rng import StatefulRNG
    from nemo_automodel.recipes.base_recipe import BaseRecipe

    class Recipe(BaseRecipe):
        """The recipe's tracked state, as `TrainFinetuneRecipeForNextTokenPrediction.setup` leaves it."""

    recipe = Recipe()
    recipe.checkpointer = Checkpointer(
        CheckpointingConfig(
            checkpoint_dir=out,
            model_save_format=model_save_format,
            save_consolidated=False,
            model_cache_dir=cache or f"{out}.hf_cache",
            is_peft=peft is not None,
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
