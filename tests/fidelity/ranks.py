"""What each gloo rank of a fidelity run does: train a tiny transformers model under FSDP2 a few steps,
save it through the Stager, and (rank 0) write the reference: `save_pretrained` of the gathered full state
dict, in the trained dtype and in bf16, and the trained model's logits on fixed input ids (for a LoRA model,
also `merged_keep/`, `merged_bf16/` and `merged.logits.pt`: its `merge_and_unload()`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.fidelity import models
from tests.fidelity.loaded import loaded_in
from tests.gloo import join

STEPS = 3
STEP = 3


def input_ids() -> Any:
    import torch

    g = torch.Generator().manual_seed(11)
    return torch.randint(0, models.VOCAB, (2, 12), generator=g)


def extras(config: Any) -> dict[str, Any]:
    """config.json as user code gives it; a tokenizer file and generation_config.json to pass through."""
    return {
        "config.json": json.loads(config.to_json_string()),
        "generation_config.json": {"bos_token_id": 1, "eos_token_id": 2, "max_new_tokens": 8},
        "tokenizer.json": b'{"version": "1.0", "model": {"type": "WordLevel"}}\n',
    }


def train_and_save(
    rank: int, world: int, init_file: str, kind: str, root: str, ref: str, save: dict[str, Any]
) -> None:
    """`save`: more keyword arguments of `Stager.save` (`extras` replaces the usual ones); `model=True`
    hands it the model."""
    join(rank, world, init_file)
    import torch
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import fully_shard

    from stagerd.training.stager import Stager

    torch.manual_seed(0)
    model = models.build(kind)
    for layer in [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    g = torch.Generator().manual_seed(5)
    for _ in range(STEPS):
        ids = torch.randint(0, models.VOCAB, (2, 12), generator=g)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    with Stager(root) as stager:
        options = {"extras": extras(model.config), **_kwargs(save, model)}
        stager.save(model.state_dict(), step=STEP, **options)
        stager.wait()
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank != 0:
        return
    out = Path(ref)
    torch.manual_seed(0)
    plain = models.build(kind)
    plain.load_state_dict(full)
    plain.eval()
    with torch.no_grad():
        if kind.endswith("_lora"):  # the merged model too: merge_and_unload, then save_pretrained
            import copy

            merged = copy.deepcopy(plain).merge_and_unload()
            torch.save(merged(input_ids=input_ids()).logits, out / "merged.logits.pt")
            merged.save_pretrained(out / "merged_keep")
            loaded_in(merged, torch.bfloat16).save_pretrained(out / "merged_bf16")
        torch.save(plain(input_ids=input_ids()).logits, out / "keep.logits.pt")
        if hasattr(plain, "save_pretrained"):  # not the torchtitan-named model
            plain.save_pretrained(out / "keep")
            loaded_in(plain, torch.bfloat16).save_pretrained(out / "bf16")


def _kwargs(save: dict[str, Any], model: Any) -> dict[str, Any]:
    """`model=True`: the model itself; `mapping=True`: the torchtitan example for its config."""
    from tests.fidelity.titan import mapping

    out = dict(save)
    if out.get("model") is True:
        out["model"] = model
    if out.get("mapping") is True:
        out["mapping"] = mapping(model.config)
    return out
