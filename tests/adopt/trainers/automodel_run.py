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
from tests.adopt.trainers.automodel_recipe import fit, save_as_recipe
from tests.gloo import join

DTYPE = "bfloat16"


def train(rank: int, world: int, init_file: str, out: str, ref: str, port: int) -> None:
    tiny.rank_env(rank, world, port)
    join(rank, world, init_file)
    import torch
    from nemo_automodel.components.models.llama.model import LlamaForCausalLM

    torch.manual_seed(0)
    cfg = tiny.config(tied=True, dtype=DTYPE)
    model, optimizer, loss = fit(LlamaForCausalLM(cfg), rank, world)
    save_as_recipe(out, rank, model, optimizer, loss)
    # the same state with `model_save_format: torch_save` (`model/` a FileSystemWriter save), beside it
    save_as_recipe(
        f"{out}-torch_save",
        rank,
        model,
        optimizer,
        loss,
        model_save_format="torch_save",
        cache=f"{out}.hf_cache",
    )
    tiny.save_reference(rank, model, cfg, ref, DTYPE)
