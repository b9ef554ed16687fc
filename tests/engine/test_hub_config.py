"""The exported config.json names the dtype its files hold (engine/hub_config.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stagerd.engine.hub_config import exported_config, main_dtype
from tests.fidelity.harness import dtype_fields, tensors


def test_the_main_dtype_is_the_floating_dtype_with_the_most_bytes():
    assert main_dtype({"BF16": 100, "F32": 10, "I64": 1000}) == "bfloat16"
    assert main_dtype({"I64": 8}) is None


def test_the_field_the_source_used_is_written_and_every_other_key_kept(tmp_path):
    src = tmp_path / "config.json"
    original = b'{"torch_dtype": "float32", "hidden_size": 8, "tie_word_embeddings": true}'
    src.write_bytes(original)
    out = json.loads(exported_config(src, {"BF16": 64, "I64": 4}) or b"")
    assert out == {"torch_dtype": "bfloat16", "hidden_size": 8, "tie_word_embeddings": True}
    assert list(out) == ["torch_dtype", "hidden_size", "tie_word_embeddings"]
    assert src.read_bytes() == original  # the staged original is never modified
    # Kept, a dtype the export holds is the one named, as save_pretrained names a mixed model by its first
    # parameter's; the most bytes name it only where the config names none, or one the export lacks.
    assert json.loads(exported_config(src, {"BF16": 64, "F32": 4}) or b"")["torch_dtype"] == "float32"
    src.write_text('{"hidden_size": 8}')
    assert json.loads(exported_config(src, {"F16": 2}) or b"") == {"hidden_size": 8, "dtype": "float16"}
    assert exported_config(src, {"U8": 2}) is None
    # A cast with --keep-dtype exceptions is named by its target, even where the kept bytes are more.
    assert json.loads(exported_config(src, {"BF16": 2, "F32": 400}, "BF16") or b"")["dtype"] == "bfloat16"


def _pair(tmp: Path, model_type: str, cls: str, dtype: str | None) -> tuple[Path, Path]:
    """A tiny composite model's save_pretrained in float32 (the source), and what the export's config.json
    must be: save_pretrained of it as from_pretrained loads it in `dtype`; kept (None), the source."""
    import torch
    import transformers as tf

    from tests.fidelity.registry.tiny import tiny_config

    model = getattr(tf, cls)(tiny_config(model_type))
    model.save_pretrained(tmp / "src")
    if dtype is None:
        return tmp / "src" / "config.json", tmp / "src"
    type(model).from_pretrained(tmp / "src", dtype=getattr(torch, dtype)).save_pretrained(tmp / "ref")
    return tmp / "src" / "config.json", tmp / "ref"


def _held(ref: Path) -> dict[str, int]:
    out: dict[str, int] = {}
    for dt, _, data in tensors(ref).values():
        out[dt] = out.get(dt, 0) + len(data)
    return out


def _rest(cfg: dict[str, object]) -> dict[str, object]:
    """A config without its dtype fields."""
    return {
        k: _rest(v) if isinstance(v, dict) else v for k, v in cfg.items() if k not in ("dtype", "torch_dtype")
    }


_TORCH = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}


@pytest.mark.parametrize(
    ("model_type", "cls", "dtype"),
    [
        ("llava", "LlavaForConditionalGeneration", "bfloat16"),
        ("llava", "LlavaForConditionalGeneration", None),
        # query_tokens, its first parameter, and the Q-Former stay float32 under fp16: the model is named
        # float32, each sub-config (the Q-Former's too) float16
        ("blip-2", "Blip2ForConditionalGeneration", "float16"),
    ],
)
def test_a_composite_models_sub_configs_name_the_dtype_from_pretrained_loaded_it_in(
    tmp_path, model_type, cls, dtype
):
    src, ref = _pair(tmp_path, model_type, cls, dtype)
    want = json.loads((ref / "config.json").read_bytes())
    subs = [k for k, v in want.items() if isinstance(v, dict) and "model_type" in v]
    assert len(subs) >= 2 and all("dtype" not in json.loads(src.read_bytes())[k] for k in subs)
    # a cast names its target on every sub-config; kept, they stay as the model's config has them
    assert all(("dtype" in want[k]) == (dtype is not None) for k in subs)
    cast = None if dtype is None else _TORCH[dtype]
    named = _TORCH[want["dtype"]] if dtype is not None and want["dtype"] != dtype else None
    got = json.loads(exported_config(src, _held(ref), cast, named) or b"")
    # the fields save_pretrained writes, and their values; every other key is the source's (transformers'
    # round trip adds `label2id: null` to each sub-config, which the export need not)
    assert dtype_fields(got) == dtype_fields(want)
    assert _rest(got) == _rest(json.loads(src.read_bytes()))


def test_a_sub_config_keeps_the_field_it_has_and_else_gets_the_models(tmp_path):
    """A 4.x config names `torch_dtype`, in its sub-configs too; a stale sub-config dtype is replaced."""
    src, ref = _pair(tmp_path, "llava", "LlavaForConditionalGeneration", "bfloat16")
    want = json.loads((ref / "config.json").read_bytes())
    cfg = json.loads(src.read_bytes())
    cfg["torch_dtype"] = cfg.pop("dtype")
    cfg["vision_config"]["dtype"] = "float16"
    src.write_text(json.dumps(cfg))
    got = json.loads(exported_config(src, _held(ref), "BF16") or b"")
    assert (
        got["torch_dtype"] == got["vision_config"]["dtype"] == got["text_config"]["torch_dtype"] == "bfloat16"
    )
    assert "dtype" not in got and "dtype" not in got["text_config"]
    got["dtype"] = got.pop("torch_dtype")
    got["text_config"]["dtype"] = got["text_config"].pop("torch_dtype")
    assert dtype_fields(got) == dtype_fields(want)
