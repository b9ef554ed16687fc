"""What each gloo rank of a trainable-tokens save does: a tiny Llama with LoRA on q_proj and
`trainable_token_indices` under FSDP2, its LoRA and token rows as if trained, saved through the Stager
with the model; rank 0 then writes the references: `save_pretrained` of the gathered model's
`merge_and_unload()` (`merged/`, in files of `SHARD` bytes `merged_sharded/`, and cast to bf16 after the
merge, `merged_bf16/`). A bf16 case keeps PEFT's float32 adapter (its default `autocast_adapter_dtype`): the
merge casts the token rows."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from tests.gloo import join
from tests.training.tiny_llama import tiny_llama

# Unsorted, adjacent runs, the first and the last row: every kind of part of the merged embedding.
INDICES = [63, 0, 7, 6, 8, 2, 30]
SHARD = 6000  # a few tensors per file: the index and each file's place are save_pretrained's


def build(tied: bool, adapters: int = 1, dtype: str = "float32") -> Any:
    import peft
    import torch

    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], trainable_token_indices=INDICES)
    model = peft.get_peft_model(tiny_llama(layers=2, dtype=dtype, tied=tied), lora)
    if adapters > 1:  # another adapter's token rows: merge_and_unload() leaves them out
        model.add_adapter(
            "other", peft.LoraConfig(r=2, target_modules=["q_proj"], trainable_token_indices=[4])
        )
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora_" in n or "trainable_tokens_delta" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model


def save(rank: int, world: int, init_file: str, cases: list[tuple[bool, int, str]], out: str) -> None:
    """Each case (tied, adapters, dtype) in `out/<tied>-<adapters>-<dtype>/` (`root/`, `ref/`), in one
    launch."""
    join(rank, world, init_file)
    for tied, adapters, dtype in cases:
        d = Path(out) / case_dir(tied, adapters, dtype)
        _save(rank, tied, adapters, dtype, d / "root", d / "ref")


def case_dir(tied: bool, adapters: int, dtype: str) -> str:
    return f"{'tied' if tied else 'untied'}-{adapters}-{dtype}"


def _save(rank: int, tied: bool, adapters: int, dtype: str, root: Path, ref: Path) -> None:
    import torch
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import fully_shard

    from stagerd.training.stager import Stager

    model = build(tied, adapters, dtype)
    for layer in [m for m in model.modules() if type(m).__name__ == "LlamaDecoderLayer"]:
        fully_shard(layer)
    fully_shard(model)
    with Stager(root) as stager:
        stager.save(model.state_dict(), step=1, model=model)
        stager.wait()
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank != 0:
        return
    plain = build(tied, adapters, dtype)
    plain.load_state_dict(full)
    merged = copy.deepcopy(plain).merge_and_unload()
    merged.save_pretrained(ref / "merged")
    merged.save_pretrained(ref / "merged_sharded", max_shard_size=SHARD)
    merged.to(torch.bfloat16).save_pretrained(ref / "merged_bf16")
