"""One rank of NeMo AutoModel 0.7 training LoRA on a tiny Qwen3-MoE, driven in-process as in
automodel_peft_run.py: its own `Qwen3MoeForCausalLM` (grouped experts, the per-expert loop on CPU), its
`apply_lora_to_linear_modules` on the attention projections and the experts (`GroupedExpertsLoRA`: one A
and B per expert for the fused gate+up, one for down), its FSDP2 on a CPU gloo mesh, two optimizer steps,
then the recipe's `save_checkpoint` with a real `Checkpointer(is_peft=True)`. Rank 0 writes the reference:
the base weights as transformers' `Qwen3MoeForCausalLM.save_pretrained` writes them (`REF/base/`), and the
trained LoRA factors by AutoModel's own names and layout (`REF/lora.safetensors`).

`hf_names=False` builds the model without its state-dict adapter (`enable_hf_state_dict_adapter`): the save
then keeps the experts' factors as AutoModel holds them, as it does for every MoE whose adapter it did not
validate for PEFT's fused layout (GPT-OSS, Qwen3-VL-MoE and others, which do not run on CPU); no reference.
`moe_rank_scaling=True` trains the experts at rank RANK // experts per token (its PeftConfig option), which
`top_k` sets (the model's `num_experts_per_tok`).

The model's `RotaryEmbedding` and `initialize_weights` ask `torch.cuda.current_device()` for a default
device they are then given explicitly (CPU): the only CUDA call on this path.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.adopt.trainers import tiny
from tests.adopt.trainers.automodel_recipe import fit, save_as_recipe
from tests.gloo import join

DTYPE = "bfloat16"
RANK, ALPHA = 4, 8
EXPERTS, HIDDEN, MOE_INTER = 4, 32, 12  # hidden != moe_inter, != 2 * moe_inter: every layout tells apart


def config(top_k: int = 2) -> Any:
    import transformers as tf

    cfg = tf.Qwen3MoeConfig(
        vocab_size=96,
        hidden_size=HIDDEN,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=64,
        num_experts=EXPERTS,
        num_experts_per_tok=top_k,
        moe_intermediate_size=MOE_INTER,
        tie_word_embeddings=False,
        dtype=DTYPE,
    )
    cfg.architectures = ["Qwen3MoeForCausalLM"]
    return cfg


def train(
    rank: int,
    world: int,
    init_file: str,
    out: str,
    ref: str,
    port: int,
    hf_names: bool = True,
    moe_rank_scaling: bool = False,
    top_k: int = 2,
) -> None:
    tiny.rank_env(rank, world, port)
    join(rank, world, init_file)
    import torch
    import transformers as tf
    from nemo_automodel.components._peft.lora import PeftConfig, apply_lora_to_linear_modules
    from nemo_automodel.components.models.common import BackendConfig
    from nemo_automodel.components.models.qwen3_moe.model import Qwen3MoeForCausalLM
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    torch.cuda.current_device = lambda: 0  # only named as a default device; CPU is passed in its place
    cpu = torch.device("cpu")
    torch.manual_seed(0)
    cfg = config(top_k)
    backend = BackendConfig(
        attn="sdpa",
        linear="torch",
        rms_norm="torch",
        experts="torch",
        dispatcher="torch",
        rope_fusion=False,
        enable_hf_state_dict_adapter=hf_names,
    )
    model = Qwen3MoeForCausalLM(cfg, backend=backend)
    model.model.rotary_emb.device = cpu
    model.initialize_weights(buffer_device=cpu)
    targets = ["*_proj", "*.experts"]
    peft = PeftConfig(target_modules=targets, dim=RANK, alpha=ALPHA, moe_rank_scaling=moe_rank_scaling)
    assert apply_lora_to_linear_modules(model, peft) > 0

    def next_token_loss(model: Any, batch: Any) -> Any:
        logits = model(input_ids=batch).logits
        return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), batch[:, 1:].flatten())

    model, optimizer, loss = fit(model, rank, world, next_token_loss)
    save_as_recipe(out, rank, model, optimizer, loss, peft=peft)

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank != 0 or not hf_names or moe_rank_scaling:
        return
    lora = {k: v.contiguous() for k, v in full.items() if ".lora_" in k}
    Path(ref).mkdir(parents=True, exist_ok=True)
    save_file(lora, str(Path(ref) / "lora.safetensors"))
    hf = model.state_dict_adapter.to_hf({k: v for k, v in full.items() if k not in lora})
    base = tf.Qwen3MoeForCausalLM(cfg).to(getattr(torch, DTYPE))
    missing, unexpected = base.load_state_dict(_fused(hf), strict=False)
    assert not unexpected and not missing, (missing, unexpected)
    base.save_pretrained(Path(ref) / "base")


def _fused(hf: dict[str, Any]) -> dict[str, Any]:
    """AutoModel's per-expert HF names (`experts.E.gate_proj.weight`) stacked as transformers 5 holds them:
    `gate_up_proj` [experts, 2 * inter, hidden] (gate rows first), `down_proj` [experts, hidden, inter]."""
    import torch

    out = {k: v for k, v in hf.items() if ".mlp.experts." not in k}
    layers = {k.split(".mlp.experts.")[0] for k in hf if ".mlp.experts." in k}
    for layer in layers:

        def stack(proj: str, layer: str = layer) -> Any:
            return torch.stack([hf[f"{layer}.mlp.experts.{e}.{proj}.weight"] for e in range(EXPERTS)])

        out[f"{layer}.mlp.experts.gate_up_proj"] = torch.cat([stack("gate_proj"), stack("up_proj")], dim=1)
        out[f"{layer}.mlp.experts.down_proj"] = stack("down_proj")
    return out
