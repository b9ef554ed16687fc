"""export_step's result describes the export as written, so callers need not read it back."""

from __future__ import annotations

import json

from stagerd.contract import layout
from stagerd.engine.export import export_step, list_files


def test_export_result_matches_the_directory(step_dir):
    res = export_step(step_dir, dtype="bf16")
    final = step_dir / layout.EXPORT_DIR
    assert res.export_dir == final and not res.skipped and res.seconds > 0
    assert res.files == list_files(final)
    index = json.loads((final / layout.INDEX_NAME).read_text())
    assert res.tensor_bytes == index["metadata"]["total_size"]
    assert res.tensors == len(index["weight_map"])
    again = export_step(step_dir, dtype="bf16")
    assert again.skipped and again.files == res.files and again.tensors == res.tensors
