"""The tiny Llama the PEFT tests adapt (tied, `tie_word_embeddings=True`, unless told), and the adapter's
trainable tensors set to seeded values, as a few training steps would leave them."""

from __future__ import annotations

from typing import Any


def tiny_llama(layers: int = 1, dtype: str = "float32", tied: bool = True) -> Any:
    import torch
    import transformers as tf

    cfg = tf.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=tied,
    )  # fmt: skip
    torch.manual_seed(0)
    return tf.LlamaForCausalLM(cfg).to(getattr(torch, dtype))


def trained(model: Any) -> Any:
    """`model` with every trainable tensor drawn from a seeded generator (away from PEFT's zero init)."""
    import torch

    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model
