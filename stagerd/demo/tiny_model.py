"""The demo's model: a 2-layer Llama-shaped language model small enough to train on CPU in seconds.

Its parameter names follow the Hugging Face Llama layout, so the export looks like a real model's."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class TinyConfig:
    vocab_size: int = 512
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4

    def as_json(self) -> dict[str, Any]:
        """The `config.json` saved beside every step."""
        return {
            "architectures": ["StagerdTinyLM"],
            "model_type": "stagerd-tiny",
            **asdict(self),
            "torch_dtype": "float32",
        }


CONFIG = TinyConfig()


class Attention(nn.Module):
    def __init__(self, c: TinyConfig) -> None:
        super().__init__()
        h = c.hidden_size
        self.heads = c.num_attention_heads
        self.q_proj = nn.Linear(h, h, bias=False)
        self.k_proj = nn.Linear(h, h, bias=False)
        self.v_proj = nn.Linear(h, h, bias=False)
        self.o_proj = nn.Linear(h, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        q, k, v = (
            p(x).view(b, t, self.heads, h // self.heads).transpose(1, 2)
            for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, h))


class Mlp(nn.Module):
    def __init__(self, c: TinyConfig) -> None:
        super().__init__()
        h, i = c.hidden_size, c.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, c: TinyConfig) -> None:
        super().__init__()
        self.input_layernorm = nn.RMSNorm(c.hidden_size)
        self.post_attention_layernorm = nn.RMSNorm(c.hidden_size)
        self.self_attn = Attention(c)
        self.mlp = Mlp(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class Body(nn.Module):
    def __init__(self, c: TinyConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(Layer(c) for _ in range(c.num_hidden_layers))
        self.norm = nn.RMSNorm(c.hidden_size)


class TinyLM(nn.Module):
    def __init__(self, c: TinyConfig = CONFIG) -> None:
        super().__init__()
        self.model = Body(c)
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.model.embed_tokens(ids)
        for layer in self.model.layers:
            x = layer(x)
        return self.lm_head(self.model.norm(x))


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy."""
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
