"""What each gloo rank does for `test_mixed_dtypes.py`: build a tiny Llama whose parameters are of two
dtypes, shard it with FSDP2, save it through the Stager with `model=`, and (rank 0) write `save_pretrained`
of the gathered weights, as the reference."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.gloo import join


def build(first: str, rest: str) -> Any:
    """The tiny Llama in `rest`, but for its first parameter (the embeddings), in `first`."""
    import torch
    import transformers as tf

    cfg = tf.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2,
    )  # fmt: skip
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(cfg).to(getattr(torch, rest))
    model.model.embed_tokens.to(getattr(torch, first))
    return model


def save(rank: int, world: int, init_file: str, first: str, rest: str, root: str, ref: str) -> None:
    join(rank, world, init_file)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import fully_shard

    from stagerd.training.stager import Stager

    model = build(first, rest)
    for module in (*model.model.layers, model.model.embed_tokens):  # one dtype in each FSDP group
        fully_shard(module)
    fully_shard(model)
    with Stager(root) as stager:
        stager.save(model.state_dict(), step=1, model=model)
        stager.wait()
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        plain = build(first, rest)
        plain.load_state_dict(full)
        plain.save_pretrained(Path(ref))
