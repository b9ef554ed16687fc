"""A tiny torchtitan Qwen3 (dense or MoE), built from torchtitan's own model package and configs, saved by
torchtitan's CheckpointManager (`step-N` folders, the last model-only) on one gloo rank; the reference is
torchtitan's own `Qwen3StateDictAdapter.to_hf` of the same weights loaded (strict) into transformers'
causal LM and written by `save_pretrained`, with config.json in the run's folder (its HF assets).

torchtitan's model package imports its expert-parallel Triton kernels; on a CPU without triton the
daemon's stand-in (`titan_names.stand_in_ep_kernels`) is installed first, as the daemon does."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.adopt.titan_ranks import checkpoint_manager
from tests.gloo import join

STEPS = 2
VOCAB, DIM, LAYERS, HEADS, KV_HEADS, HEAD_DIM, HIDDEN = 256, 64, 2, 4, 2, 16, 96
EXPERTS, TOP_K, EXPERT_HIDDEN = 4, 2, 32


def titan_config(moe: bool) -> Any:
    from stagerd.daemon.titan_names import stand_in_ep_kernels

    stand_in_ep_kernels()
    from torchtitan.models import qwen3
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear

    rope = CosSinRoPE.Config(dim=HEAD_DIM, max_seq_len=128, theta=1000000.0)
    shared = dict(n_layers=LAYERS, dim=DIM, n_heads=HEADS, n_kv_heads=KV_HEADS, head_dim=HEAD_DIM)
    if moe:
        layers = qwen3._build_qwen3_moe_layers(
            **shared, moe_hidden_dim=EXPERT_HIDDEN, num_experts=EXPERTS, top_k=TOP_K, attn_backend="flex",
            moe_comm_backend="standard", rope=rope,
        )  # fmt: skip
    else:
        layers = qwen3._build_qwen3_layers(**shared, hidden_dim=HIDDEN, attn_backend="flex", rope=rope)
    init = {"weight": qwen3._LINEAR_INIT["weight"]}
    return qwen3.Qwen3Model.Config(
        vocab_size=VOCAB,
        dim=DIM,
        norm=qwen3._qwen3_norm(DIM),
        enable_weight_tying=not moe,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM, param_init=init),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=init),
        layers=layers,
    )


def hf_config(moe: bool) -> Any:
    import transformers as tf

    shared = dict(
        vocab_size=VOCAB, hidden_size=DIM, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, rms_norm_eps=1e-6, rope_theta=1000000.0,
        max_position_embeddings=128, tie_word_embeddings=not moe,
    )  # fmt: skip
    if moe:
        return tf.Qwen3MoeConfig(
            **shared, moe_intermediate_size=EXPERT_HIDDEN, num_experts=EXPERTS, num_experts_per_tok=TOP_K,
            intermediate_size=HIDDEN, architectures=["Qwen3MoeForCausalLM"],
        )  # fmt: skip
    return tf.Qwen3Config(**shared, intermediate_size=HIDDEN, architectures=["Qwen3ForCausalLM"])


def save_and_reference(rank: int, world: int, init_file: str, base: str, ref: str, moe: bool) -> None:
    join(rank, world, init_file)
    import torch

    config = titan_config(moe)
    torch.manual_seed(0)
    model = config.build()
    _, _, ckpt, state = checkpoint_manager(model, base, STEPS)
    g = torch.Generator().manual_seed(5)
    for step in range(1, STEPS + 1):
        with torch.no_grad():  # every tensor its own values (norms start as ones): a misplaced one shows
            for p in model.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.05 + 1.0 * (p.dim() == 1))
        state.step = step
        ckpt.save(step, last_step=step == STEPS)
    ckpt.close()
    if rank == 0:
        _reference(config, model, hf_config(moe), Path(ref), Path(base))


def _reference(config: Any, model: Any, hf: Any, ref: Path, base: Path) -> None:
    """torchtitan's own to_hf of the weights, as tensors (`to_hf.safetensors`); where transformers' live
    names are those (a dense model), also `save_pretrained` of them loaded strictly (`last/`)."""
    import transformers as tf
    from safetensors.torch import save_file
    from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter

    weights = Qwen3StateDictAdapter(config, None).to_hf(dict(model.state_dict()))
    save_file({k: v.detach().contiguous().clone() for k, v in weights.items()}, ref / "to_hf.safetensors")
    if config.layers[0].moe is None:
        reference = tf.AutoModelForCausalLM.from_config(hf)
        missing, unexpected = reference.load_state_dict(weights, strict=False)
        assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
        reference.save_pretrained(ref / "last")
    (base / "config.json").write_text(json.dumps(json.loads(hf.to_json_string())))
