"""Tiny configs for any transformers model type: its default config with every size shrunk.

`tiny_config(model_type)` takes the config class's defaults (a real model's sizes), rewrites every size
field it knows in it and in its sub-configs (text, vision, audio, ...) to a few units, and builds the
config again, so the config's own checks run. `TWEAKS` holds what a model type needs beyond that.
"""

from __future__ import annotations

from typing import Any

VOCAB = 64
HIDDEN = 32
HEADS = 2
HEAD_DIM = HIDDEN // HEADS

# field -> value, wherever it appears (in the config or any sub-config)
SIZES: dict[str, Any] = {
    # widths
    "hidden_size": HIDDEN,
    "d_model": HIDDEN,
    "n_embd": HIDDEN,
    "embed_dim": HIDDEN,
    "dim": HIDDEN,
    "text_hidden_size": HIDDEN,
    "out_hidden_size": HIDDEN,
    "projection_dim": HIDDEN,
    "projector_hidden_size": HIDDEN,
    "word_embed_proj_dim": HIDDEN,
    "embedding_size": HIDDEN,
    "encoder_hidden_size": HIDDEN,
    "intermediate_size": 32,
    "ffn_dim": 32,
    "n_inner": 32,
    "d_ff": 32,
    "encoder_ffn_dim": 32,
    "decoder_ffn_dim": 32,
    "ffn_hidden_size": 32,
    "mlp_dim": 32,
    "dense_intermediate_size": 32,
    "intermediate_size_mlp": 32,
    "moe_intermediate_size": 16,
    "shared_expert_intermediate_size": 16,
    "moe_shared_expert_intermediate_size": 16,
    "shared_intermediate_size": 16,
    "shared_experts_intermediate_size": 16,
    "expert_ffn_hidden_size": 16,
    # depth
    "num_hidden_layers": 1,
    "n_layer": 1,
    "num_layers": 1,
    "n_layers": 1,
    "depth": 1,
    "encoder_layers": 1,
    "decoder_layers": 1,
    "num_decoder_layers": 1,
    # heads
    "num_attention_heads": HEADS,
    "n_head": HEADS,
    "num_heads": HEADS,
    "n_heads": HEADS,
    "encoder_attention_heads": HEADS,
    "decoder_attention_heads": HEADS,
    "attention_heads": HEADS,
    "num_key_value_heads": 1,
    "head_dim": HEAD_DIM,
    "swa_num_attention_heads": HEADS,
    "swa_num_key_value_heads": 1,
    "swa_head_dim": HEAD_DIM,
    # MLA
    "kv_lora_rank": 16,
    "q_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "qk_head_dim": 16,
    "v_head_dim": HEAD_DIM,
    "index_head_dim": 16,
    "index_n_heads": HEADS,
    "index_topk": 4,
    # experts
    "num_experts": 4,
    "n_routed_experts": 4,
    "num_local_experts": 4,
    "moe_num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_topk": 2,
    "moe_k": 2,
    "n_shared_experts": 1,
    "num_shared_experts": 1,
    "moe_num_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
    "num_expert_group": 1,
    # vocabularies and positions
    "vocab_size": VOCAB,
    "max_position_embeddings": 64,
    "n_positions": 64,
    "max_source_positions": 64,
    "max_target_positions": 64,
    # linear attention / mamba
    "linear_num_key_heads": HEADS,
    "linear_num_value_heads": HEADS,
    "linear_key_head_dim": HEAD_DIM,
    "linear_value_head_dim": HEAD_DIM,
    "mamba_n_heads": HEADS,
    "mamba_num_heads": HEADS,
    "mamba_head_dim": HEAD_DIM,
    "mamba_d_head": HEAD_DIM,
    "mamba_d_state": 8,
    "ssm_state_size": 8,
    "mamba_dt_rank": 8,
    "time_step_rank": 8,
    "state_size": 8,
    # vision
    "image_size": 32,
    # model-specific widths that follow the above
    "emb_dim": HIDDEN,
    "d_inner": 32,
    "lru_width": HIDDEN,
    "linear_head_dim": HEAD_DIM,
    "linear_num_heads": HEADS,
    "hidden_size_global": HIDDEN,
    "hidden_size_per_layer_input": 8,
    "vocab_size_per_layer_input": VOCAB,
    "encoder_hash_byte_group_vocab": VOCAB,
    "adapter_rank": 8,
    "laurel_rank": 8,
    "pronunciation_embed_dim": HIDDEN,
    "shape_embed_dim": HIDDEN,
    "pronunciation_vocab_size": VOCAB,
    "shape_vocab_size": VOCAB,
    "mamba_d_ssm": HIDDEN,
    "index_kpool": 4,
    "adapter_out_dim": HIDDEN,
    "hidden_dim": HIDDEN,
    "dim_head": HEAD_DIM,
    "audio_hidden_size": HIDDEN,
    "condition_dim": HIDDEN,
    "nemo_conv_channels": HIDDEN,
    "ext_pw_out_channel": HIDDEN,
    "depthwise_separable_out_channel": HIDDEN,
    "num_blocks": 1,
    "downsample_hidden_size": 8,
    "output_channels": 16,
    "downsample_channels": 16,
    "decoder_hidden_size": HIDDEN,
    "decoder_intermediate_size": 32,
    "decoder_num_hidden_layers": 1,
    "decoder_num_attention_heads": HEADS,
    "adapter_in_dim": HIDDEN,
    "adapter_input_size": HIDDEN,
}
MAX_LAYERS = 4  # one layer of each kind the config's per-layer lists name, at most this many


def shrink(d: dict[str, Any]) -> dict[str, Any]:
    """`d` (a config's `to_dict()`) with every known size shrunk, in its sub-config dicts too."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict) and k not in ("id2label", "label2id", "rope_parameters", "rope_scaling"):
            out[k] = shrink(v) if not _per_layer_dict(v) else v
            if not _per_layer_dict(v):  # keys some sub-configs of older transformers refuse back
                for extra in ("_name_or_path", "output_attentions"):
                    out[k].pop(extra, None)
        elif k in SIZES and _int(v) and v > SIZES[k]:
            out[k] = SIZES[k]
        elif k in SIZES and isinstance(v, list) and v and all(_int(x) for x in v):  # one per expert kind
            out[k] = [min(x, SIZES[k]) for x in v]
        else:
            out[k] = v
    _fewer_layers(d, out)
    for k in ("hidden_sizes", "depths", "num_heads", "embed_dims", "decoder_layers_per_stage"):
        if isinstance(out.get(k), list) and all(_int(x) for x in out[k]):  # a backbone's stages
            small = {"hidden_sizes": 16, "embed_dims": 16, "num_heads": 1}.get(k, 1)
            out[k] = [min(x, small) for x in out[k]]
    for k in ("out_features", "out_indices"):  # a backbone's stages to return: its default, the last
        if k in out:
            out[k] = None
    _rope_sections(out)
    for k, v in list(out.items()):
        if not k.endswith(("_token_id", "_token_index", "_id")):
            continue
        if _int(v) and v >= VOCAB:
            out[k] = VOCAB - 1
        elif isinstance(v, list) and all(_int(x) for x in v):
            out[k] = [min(x, VOCAB - 1) for x in v]
    return out


def _rope_sections(out: dict[str, Any]) -> None:
    """A multimodal RoPE's sections (time, height, width) must add up to half the rotary dims."""
    rope = out.get("rope_parameters") or out.get("rope_scaling")
    if not isinstance(rope, dict) or not isinstance(rope.get("mrope_section"), list):
        return
    heads = out.get("num_attention_heads") or HEADS
    dim = out.get("qk_rope_head_dim") or out.get("head_dim") or (out.get("hidden_size") or HIDDEN) // heads
    half, n = dim // 2, len(rope["mrope_section"])
    rope["mrope_section"] = [half - (n - 1) * (half // n), *([half // n] * (n - 1))]


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _per_layer_dict(v: dict[str, Any]) -> bool:
    return bool(v) and all(str(k).isdigit() for k in v)


def _fewer_layers(d: dict[str, Any], out: dict[str, Any]) -> None:
    """Keep one layer of each kind: every per-layer list (as long as the layer count, or `layer_types`
    when there is no count) keeps the entries of the same layers, a per-layer dict (keyed by layer
    number) the keys of those layers, renumbered."""
    count = d.get("num_hidden_layers")
    if not _int(count):
        count = len(d["layer_types"]) if isinstance(d.get("layer_types"), list) else None
    if not count or count < 2:
        return
    lists = [k for k, v in d.items() if isinstance(v, list) and len(v) == count and not k.endswith("_id")]
    kinds = [k for k in lists if all(isinstance(x, str | bool) for x in d[k])]
    keep: dict[tuple[Any, ...], int] = {}
    for i in range(count):
        keep.setdefault(tuple(d[k][i] for k in kinds), i)
    layers = sorted(keep.values())[:MAX_LAYERS]
    want = out.get("num_hidden_layers", count)
    if len(layers) < want:  # fewer kinds than the shrunk count: the first layers
        layers = sorted({*layers, *range(want)})[: max(want, len(layers))]
    for k in lists:
        out[k] = [_smaller(k, d[k][i]) for i in layers]
    for k, v in d.items():
        if isinstance(v, dict) and _per_layer_dict(v):
            out[k] = {str(j): v[str(i)] for j, i in enumerate(layers) if str(i) in v}
    if "num_hidden_layers" in d:
        out["num_hidden_layers"] = len(layers)


def _smaller(key: str, v: Any) -> Any:
    return SIZES[key] if key in SIZES and _int(v) and v > SIZES[key] else v


def variants(model_type: str) -> int:
    """How many tweaks `model_type` has: one per transformers generation whose fields differ."""
    t = TWEAKS.get(model_type, {})
    return len(t) if isinstance(t, tuple) else 1


def tiny_config(model_type: str, variant: int = 0, **over: Any) -> Any:
    """The config of `model_type` at its defaults, shrunk, with its `TWEAKS` (the `variant`-th where it
    has several) and then `over` set on top (a dotted key names a field of a sub-config:
    `text_config.head_dim`)."""
    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    own = TWEAKS.get(model_type, {})
    tweaks = {**(own[variant] if isinstance(own, tuple) else own), **over}
    try:  # the defaults, with the tweaks where a default needs them (a sub-config it leaves unset)
        default = cls(**_set({}, tweaks))
    except Exception:  # tweaks that only agree with the shrunk sizes
        default = cls()
    d = _set(shrink(default.to_dict()), tweaks)
    d.pop("transformers_version", None)
    return cls.from_dict(d)


def _set(d: dict[str, Any], values: dict[str, Any]) -> dict[str, Any]:
    """`d` with `values` set, a dotted key in the sub-config dict it names."""
    for key, value in values.items():
        *path, last = key.split(".")
        at = d
        for p in path:
            if not isinstance(at.get(p), dict):  # a sub-config left unset (None) by the default
                at[p] = {}
            at = at[p]
        at[last] = value
    return d


# What a model type needs beyond the shrinking: fields its default config leaves unset, and sizes
# that must agree with each other in ways `shrink` cannot know.
_ROPE = {"rope_type": "default", "rope_theta": 1e4}
TWEAKS: dict[str, dict[str, Any] | tuple[dict[str, Any], ...]] = {
    "inkling2_text": {"unpadded_vocab_size": VOCAB - 8},  # its checkpoint pads the vocabulary: 8 rows
    "inkling2_loop_text": {"unpadded_vocab_size": VOCAB - 8},
    "inkling2": {"text_config.unpadded_vocab_size": VOCAB - 8},
    "inkling2_loop": {"text_config.unpadded_vocab_size": VOCAB - 8},
    "hunyuan_v1_dense": {"head_dim": HEAD_DIM},
    "hunyuan_v1_moe": {"head_dim": HEAD_DIM},
    "nemotron": {"num_key_value_heads": 1},
    "dots1": {"n_shared_experts": 1, "n_routed_experts": 4, "num_experts_per_tok": 2},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_hidden_layers": 2, "num_dense_layers": 1},
    "esm": {"vocab_size": VOCAB, "pad_token_id": 1, "mask_token_id": 2},
    "diffllama": {"num_key_value_heads": 2},
    "glm5_next": {"text_config.num_key_value_heads": HEADS},
    "glm5_next_text": {"num_key_value_heads": HEADS},
    "dots3_note_text": {"num_key_value_heads": HEADS},
    "mamba2": {"n_groups": 1, "expand": 1},
    "bamba": {"mamba_expand": 1},
    "granitemoehybrid": {"mamba_expand": 1},
    "falcon_h1": {"mamba_expand": 1, "mamba_d_head": 16},
    "dots3_note": {
        "text_config.num_key_value_heads": HEADS,
        "vision_config.adapter_in_dim": HIDDEN,
        "audio_config.adapter_input_size": HIDDEN,
    },
    "qwen4_exp_text": {
        "indexer_n_heads": HEADS,
        "indexer_kv_heads": 1,
        "indexer_head_dim": HEAD_DIM,
        "indexer_budget": 8,
        "indexer_compress_ratio": 2,
    },
    "xlnet": {"d_head": HEAD_DIM},
    "ministral": {"head_dim": HEAD_DIM},
    "gpt_neo": {"attention_types": [[["global"], 1]], "attention_layers": ["global"]},
    "rwkv": {"attention_hidden_size": HIDDEN, "num_hidden_layers": 2},
    "qwen4_exp": {
        "text_config.indexer_n_heads": HEADS,
        "text_config.indexer_kv_heads": 1,
        "text_config.indexer_head_dim": HEAD_DIM,
        "text_config.indexer_budget": 8,
        "text_config.indexer_compress_ratio": 2,
    },
    "dory": {  # its config stores each layer as an attention and an mlp block: twice the counts
        "n_input_layers": 2,
        "n_recurrent_layers": 2,
        "n_output_layers": 2,
        "num_hidden_layers": 6,
        "layer_types": ["sliding_attention", "mlp"] * 3,
    },
    "cohere_compass_text": (  # its 3-D RoPE sections: per layer type, or (older transformers) one
        {"rope_parameters": {"full_attention": {**_ROPE, "mrope_section": [2, 2, 4]}}},
        {"rope_parameters": {**_ROPE, "mrope_section": [2, 2, 4]}},
    ),
    "musicgen": {  # older transformers leave its sub-configs unset by default
        "text_encoder.model_type": "t5",
        "audio_encoder.model_type": "encodec",
        "decoder.model_type": "musicgen_decoder",
    },
    "musicgen_melody": {
        "text_encoder.model_type": "t5",
        "audio_encoder.model_type": "encodec",
        "decoder.model_type": "musicgen_melody_decoder",
    },
    "dbrx": {"attn_config.rope_theta": 1e4},
    "t5gemma2_encoder": {"text_config.dropout_rate": 0.0, "vision_config.dropout_rate": 0.0},
    "gemma3n_text": {"num_kv_shared_layers": 0},
    "gemma4_unified_assistant": {"text_config.num_kv_shared_layers": 0},
    "hunyuan_vl": {"text_config.head_dim": HEAD_DIM},
    "ernie4_5_vl_moe": {
        "text_config.rope_parameters": {"rope_type": "default", "rope_theta": 5e5, "mrope_section": [2, 2, 4]}
    },
    "qwen3_omni_moe": {
        "talker_config.text_config.shared_expert_intermediate_size": 16,
        "talker_config.spatial_merge_size": 2,
    },
    "molmo2": {"adapter_config.vision_feature_layer": [0]},
    "deepseek_ocr2": {
        "text_config.n_group": 1,
        "text_config.topk_group": 1,
        "text_config.num_experts_per_tok": 2,
        "text_config.mlp_layer_types": ["dense", "sparse"],
        "text_config.num_hidden_layers": 2,
    },
    "gemma4_assistant": {
        "text_config.hidden_size_per_layer_input": 0,
        "text_config.vocab_size_per_layer_input": 0,
        "text_config.enable_moe_block": False,
        "text_config.use_double_wide_mlp": False,
        "text_config.num_kv_shared_layers": 0,
        "backbone_hidden_size": HIDDEN,
        "num_centroids": 8,
    },
    "zamba": {
        "attention_hidden_size": 2 * HIDDEN,
        "attention_head_dim": HIDDEN,
        "num_hidden_layers": 3,
        "layers_block_type": ["linear_attention", "hybrid", "hybrid"],
    },
    "zamba2": {
        "attention_hidden_size": 2 * HIDDEN,
        "attention_head_dim": HIDDEN,
        "mamba_headdim": 16,
        "n_mamba_heads": 4,
    },
    "reformer": {
        "is_decoder": True,
        "axial_pos_shape": [8, 8],
        "axial_pos_embds_dim": [16, 16],
        "attn_layers": ["local"],
        "num_hidden_layers": 1,
    },
    "llama4": {"text_config.pad_token_id": 0, "text_config.moe_layers": [0, 1]},
}
