"""The small files of a Hugging Face model that ride in a step's extras, byte for byte what
`save_pretrained` writes: `config.json` (with `architectures` and `dtype` set as `save_pretrained` sets
them, on a copy: the model's own config is not touched), `generation_config.json` for a model that
generates, and the tokenizer's (or processor's) files."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from stagerd.training import config_model, peft_plan
from stagerd.training.hf_config_files import saved_config_files


def transformers_model(model: Any) -> Any | None:
    """The transformers model behind `model`: itself, a PEFT model's base, or the one inside a wrapper."""
    if model is None:
        return None
    if peft_plan.is_peft_model(model):
        model = model.get_base_model()
    found = config_model.inner_model(model)
    return None if found is None else found.model


def model_files(model: Any) -> dict[str, bytes]:
    """`config.json` and `generation_config.json` of the transformers model behind `model` ({} if none)."""
    hf = transformers_model(model)
    return {} if hf is None else dict(saved_config_files(hf, frozenset()))


def tokenizer_files(processing_class: Any) -> dict[str, bytes]:
    """What `processing_class.save_pretrained` writes ({} without one)."""
    if processing_class is None or not hasattr(processing_class, "save_pretrained"):
        return {}
    with tempfile.TemporaryDirectory(prefix="stagerd-tokenizer-") as tmp:
        processing_class.save_pretrained(tmp)
        return _read_all(Path(tmp))


def _read_all(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}
