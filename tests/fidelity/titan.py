"""A tiny Llama written the torchtitan way: its state dict uses torchtitan's names (`tok_embeddings`,
`layers.N.attention.wq`, `feed_forward.w1`, ...) and its RoPE rotates interleaved pairs (complex numbers),
so its wq/wk rows are in Meta's order, not HF's. The same math as HF Llama otherwise."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class TitanAttention(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.wq = nn.Linear(dim, heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(heads * self.head_dim, dim, bias=False)

    def forward(self, x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.heads, self.head_dim)
        k = self.wk(x).view(b, s, self.kv_heads, self.head_dim)
        v = self.wv(x).view(b, s, self.kv_heads, self.head_dim)
        q, k = _rotate(q, freqs), _rotate(k, freqs)
        rep = self.heads // self.kv_heads
        k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


def _rotate(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(xc * freqs[: x.shape[1]].view(1, x.shape[1], 1, -1)).flatten(3).type_as(x)


class TitanFeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TitanDecoderLayer(nn.Module):
    def __init__(self, c: Any) -> None:
        super().__init__()
        self.attention = TitanAttention(c.hidden_size, c.num_attention_heads, c.num_key_value_heads)
        self.feed_forward = TitanFeedForward(c.hidden_size, c.intermediate_size)
        self.attention_norm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.ffn_norm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)

    def forward(self, x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), freqs)
        return x + self.feed_forward(self.ffn_norm(x))


class Titan(nn.Module):
    """`config`: the HF LlamaConfig this model exports as (given to the Stager in extras)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        c = config
        self.tok_embeddings = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleDict({str(i): TitanDecoderLayer(c) for i in range(c.num_hidden_layers)})
        self.norm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.output = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        head_dim = c.hidden_size // c.num_attention_heads
        inv = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
        angles = torch.outer(torch.arange(c.max_position_embeddings).float(), inv)
        self.register_buffer("freqs", torch.polar(torch.ones_like(angles), angles), persistent=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> SimpleNamespace:
        h = self.tok_embeddings(input_ids)
        for layer in self.layers.values():
            h = layer(h, self.freqs)
        logits = self.output(self.norm(h))
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
        return SimpleNamespace(logits=logits, loss=loss)


def mapping(config: Any) -> dict[str, Any]:
    """The shipped torchtitan -> HF Llama example, with this model's head counts."""
    import json
    from pathlib import Path

    spec = json.loads(
        (Path(__file__).resolve().parents[2] / "examples" / "torchtitan_llama_to_hf.json").read_text()
    )
    heads = {"wq": config.num_attention_heads, "wk": config.num_key_value_heads}
    for rule in spec["rules"]:
        if "rope_heads" in rule:
            rule["rope_heads"] = next(h for part, h in heads.items() if f"{part}\\.weight" in rule["match"])
    return spec
