"""Real small examples of what stagerd reads when it adopts a trainer's checkpoint, the fuzz's seeds: a
torchtitan-named `dcp.save` (its `.metadata` and one tensor's `torch.save` record), NeMo AutoModel's
shards of the same tensors (torch's HuggingFaceStorageWriter, as its `save_consolidated: false` runs it,
two files), Lightning's `meta.pt`
(`torch.save` of its metadata dict), and the JSON a trainer leaves beside its weights (config.json of a
dense and a composite model, AutoModel's adapter_config.json and automodel_peft_config.json, the index of
torchtitan's `last_save_in_hf`)."""

from __future__ import annotations

import io
import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# What torchtitan's Llama / Qwen3 checkpoints hold, one small layer (names as its CheckpointManager saves)
TITAN_SHAPES = {
    "tok_embeddings.weight": (16, 8),
    "layers.0.attention.wq.weight": (8, 8),
    "layers.0.attention.wk.weight": (4, 8),
    "layers.0.attention.wv.weight": (4, 8),
    "layers.0.attention.wo.weight": (8, 8),
    "layers.0.feed_forward.w1.weight": (12, 8),
    "layers.0.feed_forward.w2.weight": (8, 12),
    "layers.0.feed_forward.w3.weight": (12, 8),
    "layers.0.attention_norm.weight": (8,),
    "layers.0.ffn_norm.weight": (8,),
    "norm.weight": (8,),
    "output.weight": (16, 8),
}
CONFIG = {
    "architectures": ["Qwen3ForCausalLM"],
    "attention_bias": False,
    "bos_token_id": 1,
    "dtype": "bfloat16",
    "eos_token_id": 2,
    "head_dim": 4,
    "hidden_size": 8,
    "intermediate_size": 12,
    "max_position_embeddings": 64,
    "model_type": "qwen3",
    "num_attention_heads": 2,
    "num_hidden_layers": 1,
    "num_key_value_heads": 1,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "transformers_version": "4.57.1",
    "use_cache": True,
    "vocab_size": 16,
}
COMPOSITE = {
    "architectures": ["Qwen3VLMoeForConditionalGeneration"],
    "model_type": "qwen3_vl_moe",
    "torch_dtype": "float32",
    "text_config": {"model_type": "qwen3_vl_moe_text", "num_experts": 4, "num_experts_per_tok": 2},
    "vision_config": {"model_type": "qwen3_vl_moe", "depth": 1, "out_hidden_size": 8},
}
ADAPTER_CONFIG = {
    "base_model_name_or_path": "tiny",
    "peft_type": "LORA",
    "r": 8,
    "lora_alpha": 16,
    "rank_pattern": {},
    "target_modules": ["q_proj", "v_proj"],
    "target_parameters": ["experts.gate_up_proj"],
    "task_type": "CAUSAL_LM",
}
AUTOMODEL_PEFT_CONFIG = {"dim": 8, "alpha": 32, "moe_rank_scaling": True, "target_modules": ["*.experts"]}


def index_of(shapes: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    """`model.safetensors.index.json` as `consolidate_safetensors_files_on_every_rank` writes it."""
    names = sorted(shapes)
    wm = {n: f"model-0000{1 + i % 2}-of-00002.safetensors" for i, n in enumerate(names)}
    return {"metadata": {"total_size": 2048}, "weight_map": wm}


@dataclass(frozen=True)
class AdoptSeeds:
    metadata: bytes  # a FileSystemWriter `.metadata`
    records: tuple[bytes, ...]  # `torch.save` records out of its `.distcp` file, one per dtype
    meta_pt: bytes  # Lightning's meta.pt
    jsons: dict[str, Any]  # seed name -> JSON object
    save: Path  # the dcp.save they came from (`.metadata`, `__0_0.distcp`)
    shards: dict[str, bytes]  # AutoModel's model/ (save_consolidated: false): file name -> bytes


def make_seeds(tmp: Path) -> AdoptSeeds:
    """Save a torchtitan-named state dict as torchtitan does (one process) and read its files back."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    from stagerd.contract.adopt.dcp_metadata import parse_dcp_metadata

    g = torch.Generator().manual_seed(0)
    sd: dict[str, Any] = {k: torch.randn(*s, generator=g) for k, s in TITAN_SHAPES.items()}
    sd["norm.weight"] = sd["norm.weight"].to(torch.bfloat16)
    sd["layers.0.ffn_norm.weight"] = sd["layers.0.ffn_norm.weight"].to(torch.float8_e4m3fn)  # a v3 record
    sd["train_state"] = {"step": 5}
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(sd, checkpoint_id=str(tmp), no_dist=True)
    raw = (tmp / ".metadata").read_bytes()
    meta = parse_dcp_metadata(raw, tmp)
    records = []
    for name in ("norm.weight", "layers.0.ffn_norm.weight", "tok_embeddings.weight"):
        c = meta.tensors[name].chunks[0]
        records.append((tmp / c.file).read_bytes()[c.offset : c.offset + c.length])
    shards = tmp / "automodel"
    hf_names = {f"model.{k}": v for k, v in sd.items() if k != "train_state"}
    writer = HuggingFaceStorageWriter(
        str(shards),
        save_distributed=True,
        fqn_to_index_mapping={k: 1 + i % 2 for i, k in enumerate(hf_names)},
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(hf_names, storage_writer=writer, no_dist=True)
    buf = io.BytesIO()
    # what Lightning's FSDPStrategy.save_checkpoint writes beside the DCP files (its `_METADATA_FILENAME`)
    torch.save({"epoch": 0, "global_step": 5, "pytorch-lightning_version": "2.5.0", "loops": {}}, buf)
    jsons = {
        "config": CONFIG,
        "composite": COMPOSITE,
        "adapter_config": ADAPTER_CONFIG,
        "automodel_peft_config": AUTOMODEL_PEFT_CONFIG,
        "index": index_of(TITAN_SHAPES),
    }
    return AdoptSeeds(
        raw,
        tuple(records),
        buf.getvalue(),
        json.loads(json.dumps(jsons)),
        tmp,
        {p.name: p.read_bytes() for p in sorted(shards.glob("*.safetensors"))},
    )
