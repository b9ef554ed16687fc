"""An adopted DCP checkpoint exported in several files is split as `save_pretrained` splits the model: its
files filled in the order the trainer's state dict lists the tensors (the order `.metadata` keeps), not
in name order."""

from __future__ import annotations

import pytest

from stagerd.engine.adopt.export import export_adopted
from tests.adopt import shard_ranks
from tests.fidelity import harness
from tests.gloo import launch


@pytest.mark.parametrize("kind", ["llama", "llama_tied"])
def test_an_adopted_sharded_export_is_the_files_save_pretrained_writes(tmp_path, kind):
    root, ref = tmp_path / "root", tmp_path / "ref"
    launch(shard_ranks.dcp_save, str(root), str(ref), kind, deadline_s=120)
    for mode, dtype in (("keep", None), ("bf16", "BF16")):
        res = export_adopted(
            root / "step-1", tmp_path / f"work-{mode}", dtype=dtype, max_shard_size=shard_ranks.MAX_SHARD
        )
        assert len(list(res.export_dir.glob("*.safetensors"))) > 3
        harness.assert_same_weight_files(res.export_dir, ref / mode)
