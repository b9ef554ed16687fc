"""A model whose parameters are of two dtypes, exported with its dtypes kept: config.json names the dtype
`save_pretrained` names, its first floating parameter's, wherever most of the bytes are."""

from __future__ import annotations

import pytest

from stagerd.contract import layout
from stagerd.contract.sharding import DEFAULT_MAX_SHARD_SIZE
from stagerd.engine.export import build_export
from stagerd.engine.source import open_source
from tests.engine import mixed_ranks
from tests.fidelity import harness
from tests.gloo import launch


@pytest.mark.parametrize(("first", "rest"), [("float32", "bfloat16"), ("bfloat16", "float32")])
def test_a_mixed_model_kept_is_what_save_pretrained_writes(tmp_path, first, rest):
    root, ref, out = tmp_path / "root", tmp_path / "ref", tmp_path / "out"
    launch(mixed_ranks.save, first, rest, str(root), str(ref), deadline_s=120)
    out.mkdir()
    build_export(
        open_source(root / layout.step_dir_name(1)), out, dtype=None, keep_dtype=None, reference=None,
        max_shard_size=DEFAULT_MAX_SHARD_SIZE, threads=1, progress=None,
    )  # fmt: skip
    harness.assert_same_weight_files(out, ref)
    assert harness.config_dtype(ref) == first
    assert (out / "config.json").read_bytes() == (ref / "config.json").read_bytes()
