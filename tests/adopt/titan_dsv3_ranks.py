"""A tiny torchtitan DeepSeek V3 (MLA with or without a low-rank query, one dense layer then one MoE layer
with shared experts and a routing bias; yarn RoPE), built from torchtitan's own model package and configs,
saved by torchtitan's CheckpointManager (`step-N` folders, the last model-only) on one gloo rank. The
reference is torchtitan's own `DeepSeekV3StateDictAdapter.to_hf` of the same weights with config.json
(`to_hf/`), those loaded by transformers' `DeepseekV3ForCausalLM.from_pretrained` (nothing missing or
unexpected) and written by `save_pretrained` (`last/`), and the torchtitan model's own forward on
`tokens()` (`titan.pt`: logits and layer 0's output); config.json also goes into the run's folder (its HF
assets).

torchtitan's model package imports its expert-parallel Triton kernels; on a CPU without triton the
daemon's stand-in (`titan_names.stand_in_ep_kernels`) is installed first, as the daemon does."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.adopt.titan_ranks import checkpoint_manager
from tests.gloo import join

STEPS = 2
VOCAB, DIM, LAYERS, DENSE_LAYERS, HEADS, HIDDEN = 256, 64, 2, 1, 4, 96
Q_LORA, KV_LORA, NOPE, ROPE, V_HEAD = 32, 16, 16, 8, 16
EXPERTS, SHARED, TOP_K, EXPERT_HIDDEN = 4, 1, 2, 32
THETA, SEQ = 10000.0, 128
# torchtitan's flavors scale RoPE by yarn; its `mscale` is transformers' mscale and mscale_all_dim both
YARN = {"factor": 4.0, "original_max_position_embeddings": 32, "beta_fast": 32.0, "beta_slow": 1.0}
MSCALE = 0.7


def tokens() -> Any:
    import torch

    return torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(11))


def titan_config(q_lora: bool) -> Any:
    from stagerd.daemon.titan_names import stand_in_ep_kernels

    stand_in_ep_kernels()
    from torchtitan.models import deepseek_v3 as dsv3
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm

    layers = dsv3._build_dsv3_layers(
        n_layers=LAYERS, n_dense_layers=DENSE_LAYERS, dim=DIM, n_heads=HEADS,
        q_lora_rank=Q_LORA if q_lora else 0, kv_lora_rank=KV_LORA, qk_nope_head_dim=NOPE,
        qk_rope_head_dim=ROPE, v_head_dim=V_HEAD, mscale=MSCALE, dense_hidden_dim=HIDDEN,
        moe_hidden_dim=EXPERT_HIDDEN, num_experts=EXPERTS, num_shared_experts=SHARED, router_top_k=TOP_K,
        router_score_func="sigmoid", router_route_norm=True, router_route_scale=1.5, attn_backend="flex",
        moe_comm_backend="standard", non_blocking_capacity_factor=None,
        rope=ComplexRoPE.Config(
            dim=ROPE, max_seq_len=SEQ, theta=THETA, scaling="yarn", rope_factor=YARN["factor"],
            beta_fast=YARN["beta_fast"], beta_slow=YARN["beta_slow"],
            original_seq_len=YARN["original_max_position_embeddings"],
        ),
    )  # fmt: skip
    return dsv3.DeepSeekV3Model.Config(
        vocab_size=VOCAB,
        dim=DIM,
        tok_embeddings=Embedding.Config(
            num_embeddings=VOCAB, embedding_dim=DIM, param_init=dsv3._EMBEDDING_INIT
        ),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init=dsv3._NORM_INIT),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=dsv3._output_linear_init(DIM)),
        layers=layers,
        mtp_layers=[],
    )


def hf_config(q_lora: bool) -> Any:
    import transformers as tf

    # what transformers' DeepSeek V3 computes as torchtitan's does: sigmoid routing (transformers' only
    # kind), one expert group, torchtitan's RMSNorm eps (1e-5; transformers' default is 1e-6), the same yarn
    return tf.DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=DIM, intermediate_size=HIDDEN, moe_intermediate_size=EXPERT_HIDDEN,
        num_hidden_layers=LAYERS, first_k_dense_replace=DENSE_LAYERS, num_attention_heads=HEADS,
        num_key_value_heads=HEADS, n_shared_experts=SHARED, n_routed_experts=EXPERTS,
        num_experts_per_tok=TOP_K, n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=1.5,
        q_lora_rank=Q_LORA if q_lora else None, kv_lora_rank=KV_LORA, qk_nope_head_dim=NOPE,
        qk_rope_head_dim=ROPE, v_head_dim=V_HEAD, rope_interleave=True, rms_norm_eps=1e-5,
        rope_parameters={
            "rope_type": "yarn", "rope_theta": THETA, **YARN, "mscale": MSCALE, "mscale_all_dim": MSCALE,
        }, max_position_embeddings=SEQ,
        tie_word_embeddings=False, num_mtp_layers=0, architectures=["DeepseekV3ForCausalLM"],
    )  # fmt: skip


def fill(model: Any, seed: int) -> None:
    """Every tensor its own values (norms about one, the routing bias small): a misplaced one shows."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in model.state_dict().items():
            one = t.dim() == 1 and "expert_bias" not in name
            t.copy_(torch.randn(t.shape, generator=g) * 0.05 + 1.0 * one)


def titan_forward(model: Any) -> tuple[Any, Any]:
    """torchtitan's forward on `tokens()`: the logits, and the output of layer 0 (the dense one)."""
    import torch

    ids = tokens()
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    seen = []
    hook = model.layers["0"].register_forward_hook(lambda mod, args, out: seen.append(out.detach().float()))
    with torch.no_grad():
        logits = model(ids, positions, model.get_attention_masks(positions)).float()
    hook.remove()
    return logits, seen[0]


def save_and_reference(rank: int, world: int, init_file: str, base: str, ref: str, q_lora: bool) -> None:
    join(rank, world, init_file)
    import torch

    config = titan_config(q_lora)
    torch.manual_seed(0)
    model = config.build()
    _, _, ckpt, state = checkpoint_manager(model, base, STEPS)
    for step in range(1, STEPS + 1):
        fill(model, step)
        state.step = step
        ckpt.save(step, last_step=step == STEPS)
    ckpt.close()
    if rank == 0:
        reference(config, model, hf_config(q_lora), Path(ref), Path(base))


def reference(config: Any, model: Any, hf: Any, ref: Path, base: Path) -> None:
    import torch
    import transformers as tf
    from safetensors.torch import save_file
    from torchtitan.models.deepseek_v3.state_dict_adapter import DeepSeekV3StateDictAdapter

    weights = DeepSeekV3StateDictAdapter(config, None).to_hf(dict(model.state_dict()))
    # transformers 5 fuses the experts it loads: to_hf's per-expert names are its checkpoint's, not its live
    # model's, so they go in through from_pretrained
    (ref / "to_hf").mkdir()
    save_file(
        {k: v.detach().contiguous().clone() for k, v in weights.items()}, ref / "to_hf" / "model.safetensors"
    )
    hf.save_pretrained(ref / "to_hf")
    loaded, info = tf.AutoModelForCausalLM.from_pretrained(ref / "to_hf", output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    loaded.save_pretrained(ref / "last")
    logits, layer0 = titan_forward(model)
    torch.save({"logits": logits, "layer0": layer0}, ref / "titan.pt")
    (base / "config.json").write_text(json.dumps(json.loads(hf.to_json_string())))
