"""torchtitan's Llama 3 tensor names and the rules that give transformers' LlamaForCausalLM names for them
(the `torchtitan` preset's key mapping)."""

from __future__ import annotations

from typing import Any

# torchtitan's Llama 3 names -> transformers' LlamaForCausalLM. torchtitan 0.3 calls the projections
# `attention.qkv_linear.wq` and the head `lm_head`; earlier releases `attention.wq` and `output`. Also in
# examples/torchtitan_llama_to_hf.json (with the numbers of Llama 3 8B for rope_heads).
TORCHTITAN_LLAMA_RULES: list[dict[str, Any]] = [
    {"match": r"tok_embeddings\.weight", "name": "model.embed_tokens.weight"},
    {
        "match": r"layers\.(\d+)\.attention\.(?:qkv_linear\.)?wq\.weight",
        "name": r"model.layers.\1.self_attn.q_proj.weight",
        "rope_heads": "num_attention_heads",
    },
    {
        "match": r"layers\.(\d+)\.attention\.(?:qkv_linear\.)?wk\.weight",
        "name": r"model.layers.\1.self_attn.k_proj.weight",
        "rope_heads": "num_key_value_heads",
    },
    {
        "match": r"layers\.(\d+)\.attention\.(?:qkv_linear\.)?wv\.weight",
        "name": r"model.layers.\1.self_attn.v_proj.weight",
    },
    {"match": r"layers\.(\d+)\.attention\.wo\.weight", "name": r"model.layers.\1.self_attn.o_proj.weight"},
    {"match": r"layers\.(\d+)\.feed_forward\.w1\.weight", "name": r"model.layers.\1.mlp.gate_proj.weight"},
    {"match": r"layers\.(\d+)\.feed_forward\.w2\.weight", "name": r"model.layers.\1.mlp.down_proj.weight"},
    {"match": r"layers\.(\d+)\.feed_forward\.w3\.weight", "name": r"model.layers.\1.mlp.up_proj.weight"},
    {
        "match": r"layers\.(\d+)\.attention_norm\.weight",
        "name": r"model.layers.\1.input_layernorm.weight",
    },
    {
        "match": r"layers\.(\d+)\.ffn_norm\.weight",
        "name": r"model.layers.\1.post_attention_layernorm.weight",
    },
    {"match": r"norm\.weight", "name": "model.norm.weight"},
    {"match": r"(?:output|lm_head)\.weight", "name": "lm_head.weight"},
]
