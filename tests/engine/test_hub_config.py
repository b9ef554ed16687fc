"""The exported config.json names the dtype its files hold (engine/hub_config.py)."""

from __future__ import annotations

import json

from stagerd.engine.hub_config import exported_config, main_dtype


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
