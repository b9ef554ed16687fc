"""export_step's result describes the export as written, so callers need not read it back."""

from __future__ import annotations

from stagerd.contract import layout
from stagerd.engine.export import export_step, list_files
from tests.export_index import export_index


def test_export_result_matches_the_directory(step_dir):
    res = export_step(step_dir, dtype="bf16")
    final = step_dir / layout.EXPORT_DIR
    assert res.export_dir == final and not res.skipped and res.seconds > 0
    assert res.files == list_files(final)
    index = export_index(final)
    assert res.tensor_bytes == index["metadata"]["total_size"]
    assert res.tensors == len(index["weight_map"])
    again = export_step(step_dir, dtype="bf16")
    assert again.skipped and again.files == res.files and again.tensors == res.tensors


def test_a_killed_merges_scratch_is_removed_by_the_next_export(step_dir):
    # A LoRA merge's scratch lives beside export.tmp/; kill -9 leaves it, and nothing else would remove it.
    scratch = step_dir / ".stagerd-merge-abc123"
    scratch.mkdir()
    (scratch / "merged.safetensors").write_bytes(b"\0" * 4096)
    (step_dir / layout.EXPORT_TMP_DIR).mkdir()

    export_step(step_dir)

    assert not scratch.exists() and not (step_dir / layout.EXPORT_TMP_DIR).exists()
    assert (step_dir / layout.EXPORT_DIR / layout.WEIGHTS_NAME).is_file()
