"""What each gloo rank of a tied-embeddings PEFT save does: a tiny tied Llama (`tie_word_embeddings=True`)
with an adapter per case (`CASES`), its trainable parameters as if trained, under FSDP2, saved through
the Stager with the model. Each rank also resolves the to-Hub plan itself (only rank 0's goes into the
marker): rank 0 checks that every rank's is its own. Rank 0 then writes the reference: `save_pretrained`
of the gathered model's `merge_and_unload()` (`ref/`)."""

from __future__ import annotations

import copy
import warnings
from pathlib import Path
from typing import Any

from tests.gloo import join
from tests.training.tiny_llama import tiny_llama, trained

# name -> LoraConfig arguments
CASES: dict[str, dict[str, Any]] = {
    # PEFT trains a copy of each side: merge_and_unload() unties them (config tie false)
    "copies": {"target_modules": ["q_proj"], "modules_to_save": ["embed_tokens", "lm_head"]},
    # a copy of one side: the output layer stays on the original, untied (config tie false)
    "embed-copy": {"target_modules": ["q_proj"], "modules_to_save": ["embed_tokens"]},
    # one copy, the output layer's too: still tied, config as it was
    "copy-tied": {
        "target_modules": ["q_proj"],
        "modules_to_save": ["embed_tokens"],
        "ensure_weight_tying": True,
    },
    # the embeddings untouched: tied, config as it was
    "attention": {"target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]},
}
LIMIT = 3000  # a few tensors per file: the index, with its parameter count, is written and compared


def build(case: str) -> Any:
    import peft

    base = tiny_llama(layers=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PEFT's own warning about a tied layer without ensure_weight_tying
        model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, **CASES[case]))
    return trained(model)


def save(rank: int, world: int, init_file: str, cases: list[str], out: str) -> None:
    """Each case in `out/<case>/` (`root/`, `ref/`), in one launch."""
    join(rank, world, init_file)
    for case in cases:
        _save(rank, world, case, Path(out) / case)


def _save(rank: int, world: int, case: str, d: Path) -> None:
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import fully_shard

    from stagerd.training import to_hub
    from stagerd.training.aliases import split_aliases
    from stagerd.training.stager import Stager

    model = build(case)
    for layer in [m for m in model.modules() if type(m).__name__ == "LlamaDecoderLayer"]:
        fully_shard(layer)
    fully_shard(model)
    with Stager(d / "root") as stager:
        stager.save(model.state_dict(), step=1, model=model)
        stager.wait()
    # The plan as this rank would resolve it: its own DTensor shards, its own storages.
    sd, aliases = split_aliases(model.state_dict())
    mine = to_hub.resolve(model, sd, aliases)
    plans: list[Any] = [None] * world
    dist.all_gather_object(plans, mine)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank != 0:
        return
    for r, theirs in enumerate(plans):
        assert _comparable(theirs) == _comparable(plans[0]), f"{case}: rank {r} resolves another plan"
    plain = build(case)
    plain.load_state_dict(full)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PEFT's: "no longer tied after merging"
        merged = copy.deepcopy(plain).merge_and_unload()
    merged.save_pretrained(d / "ref", max_shard_size=LIMIT)


def _comparable(hub: Any) -> Any:
    """`hub` with adapter_config.json's lists in one order: PEFT writes a set (`target_modules`) as a
    list in the order of the process's string hashes, which each rank seeds apart."""
    import json

    extras = dict(hub.extras)
    cfg = json.loads(extras.pop("adapter/adapter_config.json"))
    return hub.plan, hub.adapter, extras, {k: sorted(v) if isinstance(v, list) else v for k, v in cfg.items()}
