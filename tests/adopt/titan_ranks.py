"""torchtitan 0.3's own checkpointing, driven in-process on 2 gloo ranks (CPU, FSDP2).

torchtitan's model package imports Triton kernels when it is imported (its MoE expert-parallel path), and
Triton is a 1 GB wheel with nothing to do on CPU; so the model here is a tiny Llama written with
torchtitan 0.3's module names (`tok_embeddings`, `layers.N.attention.qkv_linear.wq`, `feed_forward.w1`,
`lm_head`, interleaved-pair RoPE as torchtitan's ComplexRoPE computes it), and everything that writes the
checkpoint is torchtitan's: its `OptimizersContainer`, `LRSchedulersContainer` and `CheckpointManager`
(ModelWrapper flattening, `step-N` folders, `async_mode="async"` on its own gloo group, and the last step
saved model-only in `export_dtype`). Rank 0 writes the reference: the trained weights as an HF
`LlamaForCausalLM` (renamed, q and k rows permuted in torch as torchtitan's own
Llama3StateDictAdapter.to_hf does), `save_pretrained` in the last save's dtype, and config.json into the
run's folder (its HF assets).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.fidelity import models
from tests.gloo import join

STEPS = 3
LAST_DTYPE = "bfloat16"  # torchtitan's checkpoint.export_dtype for the last, model-only save


def _model(config: Any) -> Any:
    import torch
    import torch.nn.functional as F
    from torch import nn

    from tests.fidelity.titan import _rotate

    c = config
    head = c.hidden_size // c.num_attention_heads

    class QKV(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wq = nn.Linear(c.hidden_size, c.num_attention_heads * head, bias=False)
            self.wk = nn.Linear(c.hidden_size, c.num_key_value_heads * head, bias=False)
            self.wv = nn.Linear(c.hidden_size, c.num_key_value_heads * head, bias=False)

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv_linear = QKV()
            self.wo = nn.Linear(c.num_attention_heads * head, c.hidden_size, bias=False)

        def forward(self, x: Any, freqs: Any) -> Any:
            b, s, _ = x.shape
            q = self.qkv_linear.wq(x).view(b, s, -1, head)
            k = self.qkv_linear.wk(x).view(b, s, -1, head)
            v = self.qkv_linear.wv(x).view(b, s, -1, head)
            q, k = _rotate(q, freqs), _rotate(k, freqs)
            rep = c.num_attention_heads // c.num_key_value_heads
            k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
            o = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=True)
            return self.wo(o.transpose(1, 2).reshape(b, s, -1))

    class FeedForward(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w1 = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
            self.w2 = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)
            self.w3 = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)

        def forward(self, x: Any) -> Any:
            return self.w2(F.silu(self.w1(x)) * self.w3(x))

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attention, self.feed_forward = Attention(), FeedForward()
            self.attention_norm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
            self.ffn_norm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)

        def forward(self, x: Any, freqs: Any) -> Any:
            x = x + self.attention(self.attention_norm(x), freqs)
            return x + self.feed_forward(self.ffn_norm(x))

    class Decoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok_embeddings = nn.Embedding(c.vocab_size, c.hidden_size)
            self.layers = nn.ModuleDict({str(i): Block() for i in range(c.num_hidden_layers)})
            self.norm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
            self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
            inv = 1.0 / (10000.0 ** (torch.arange(0, head, 2).float() / head))
            angles = torch.outer(torch.arange(c.max_position_embeddings).float(), inv)
            self.register_buffer("freqs", torch.polar(torch.ones_like(angles), angles), persistent=False)

        def forward(self, ids: Any) -> Any:
            h = self.tok_embeddings(ids)
            for layer in self.layers.values():
                h = layer(h, self.freqs)
            return self.lm_head(self.norm(h))

    return Decoder()


class TrainState:
    """The trainer's own `train_state` entry (torchtitan saves the Trainer object's step there)."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.step = sd["step"]


def checkpoint_manager(model: Any, base: str, steps: int, **options: Any) -> tuple[Any, Any, Any, TrainState]:
    """torchtitan's own optimizers, LR schedulers and CheckpointManager (every step, the last model-only)
    for `model`, as its Trainer builds them: (optimizers, lr_schedulers, manager, train_state)."""
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.optimizer import (
        LRSchedulersContainer,
        OptimizersContainer,
        ParamGroupConfig,
    )

    groups = [ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-2})]
    optimizers = OptimizersContainer.Config(param_groups=groups, implementation="for-loop").build(
        model_parts=[model]
    )
    lrs = LRSchedulersContainer.Config(warmup_steps=1).build(optimizers=optimizers, training_steps=steps)
    state = TrainState()
    ckpt = CheckpointManager.Config(
        enable=True, folder="checkpoint", interval=1, keep_latest_k=0, last_save_model_only=True, **options
    ).build(
        dataloader=None, model_parts=[model], optimizers=optimizers, lr_schedulers=lrs,
        states={"train_state": state}, sd_adapter=None, base_folder=base,
    )  # fmt: skip
    return optimizers, lrs, ckpt, state


def train_and_checkpoint(rank: int, world: int, init_file: str, base: str, ref: str) -> None:
    join(rank, world, init_file)
    import torch
    import torch.nn.functional as F
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import fully_shard

    config = models.config("titan")
    torch.manual_seed(0)
    model = _model(config)
    for layer in model.layers.values():
        fully_shard(layer)
    fully_shard(model)
    optimizers, lrs, ckpt, state = checkpoint_manager(
        model, base, STEPS, async_mode="async", export_dtype=LAST_DTYPE
    )
    g = torch.Generator().manual_seed(5)
    for step in range(1, STEPS + 1):
        ids = torch.randint(0, models.VOCAB, (2, 12), generator=g)
        logits = model(ids)
        F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).backward()
        optimizers.step()
        lrs.step()
        optimizers.zero_grad()
        state.step = step
        ckpt.save(step, last_step=step == STEPS)
    ckpt.maybe_wait_for_saving()
    ckpt.close()
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        _reference(config, full, Path(ref), Path(base))


def hf_state_dict(config: Any, titan: dict[str, Any]) -> dict[str, Any]:
    """torchtitan names -> HF Llama names, with the RoPE row permutation for q and k in torch, as
    torchtitan's Llama3StateDictAdapter and transformers' old conversion script compute it."""

    def permute(w: Any, heads: int, rows: int, cols: int) -> Any:
        return w.view(heads, rows // heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)

    c, out = config, {}
    for key, w in titan.items():
        parts = key.split(".")
        if key == "tok_embeddings.weight":
            out["model.embed_tokens.weight"] = w
        elif key == "norm.weight":
            out["model.norm.weight"] = w
        elif key == "lm_head.weight":
            out["lm_head.weight"] = w
        else:
            i, rest = parts[1], ".".join(parts[2:])
            names = {
                "attention.qkv_linear.wq.weight": "self_attn.q_proj.weight",
                "attention.qkv_linear.wk.weight": "self_attn.k_proj.weight",
                "attention.qkv_linear.wv.weight": "self_attn.v_proj.weight",
                "attention.wo.weight": "self_attn.o_proj.weight",
                "feed_forward.w1.weight": "mlp.gate_proj.weight",
                "feed_forward.w2.weight": "mlp.down_proj.weight",
                "feed_forward.w3.weight": "mlp.up_proj.weight",
                "attention_norm.weight": "input_layernorm.weight",
                "ffn_norm.weight": "post_attention_layernorm.weight",
            }
            if rest.endswith("wq.weight"):
                w = permute(w, c.num_attention_heads, w.shape[0], w.shape[1])
            elif rest.endswith("wk.weight"):
                w = permute(w, c.num_key_value_heads, w.shape[0], w.shape[1])
            out[f"model.layers.{i}.{names[rest]}"] = w
    return out


def _reference(config: Any, full: dict[str, Any], ref: Path, base: Path) -> None:
    import torch
    import transformers as tf

    model = tf.LlamaForCausalLM(config)
    missing, unexpected = model.load_state_dict(hf_state_dict(config, full), strict=True)
    assert not missing and not unexpected
    model.to(getattr(torch, LAST_DTYPE)).save_pretrained(ref / "last")
    (base / "config.json").write_text(json.dumps(json.loads(config.to_json_string())))
