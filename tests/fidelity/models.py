"""Tiny transformers models built from configs (nothing is downloaded), one builder per architecture."""

from __future__ import annotations

from typing import Any

VOCAB = 96


def config(kind: str, **over: Any) -> Any:
    """The tiny config of `kind`: llama, llama_tied, qwen3_moe, qwen3_moe_tied, mixtral, mistral_large4;
    llama_lora's is llama's. `over`: fields set on top (a dtype) of the llama, qwen3_moe and mixtral ones."""
    import transformers as tf

    common: dict[str, Any] = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=kind.endswith("_tied"),
        **over,
    )
    base = kind.removesuffix("_tied").removesuffix("_lora").replace("titan", "llama")
    if base == "llama":
        return tf.LlamaConfig(**common)
    if base == "qwen3_moe":
        return tf.Qwen3MoeConfig(
            **common, head_dim=8, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=16
        )
    if base == "mixtral":
        return tf.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2)
    if base == "mistral_large4":  # its registry's PermuteForRope regroups the vision q/k rows per head
        from transformers.models.mistral_large4.configuration_mistral_large4 import (
            MistralLarge4Config,
            MistralLarge4TextConfig,
        )

        text = MistralLarge4TextConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=32,
            moe_intermediate_size=16,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=2,
            n_routed_experts=4,
            num_experts_per_tok=2,
            kv_lora_rank=16,
            q_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=8,
            head_dim=8,
            index_topk=4,
            index_head_dim=16,
            index_n_heads=2,
            first_k_dense_replace=1,
            max_position_embeddings=64,
        )
        vision = tf.PixtralVisionConfig(
            hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, head_dim=16,
            image_size=32, patch_size=8,
        )  # fmt: skip
        return MistralLarge4Config(vision_config=vision, text_config=text)
    raise ValueError(kind)


def build(kind: str) -> Any:
    """The model of `kind`, initialised from the current torch seed, in float32. `llama_lora`: a PEFT
    LoRA on llama's attention, whose base is `build("llama")` from the same seed."""
    import transformers as tf

    if kind == "titan":
        from tests.fidelity.titan import Titan

        return Titan(config(kind))
    if kind == "mistral_large4":
        return tf.MistralLarge4ForConditionalGeneration(config(kind))
    model = tf.AutoModelForCausalLM.from_config(config(kind))
    if kind.endswith("_lora"):
        import peft

        lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
        model = peft.get_peft_model(model, lora)
    return model
