"""LoRA with `trainable_token_indices` under FSDP2 on 2 gloo ranks: the main export is `save_pretrained`
of `merge_and_unload()`, byte for byte, the embedding's trained rows merged in. Before, it held PEFT's
`model.embed_tokens.token_adapter.{weight,trainable_tokens_delta.default}`, and `from_pretrained`
initialised `model.embed_tokens.weight` at random without a warning."""

from __future__ import annotations

import pytest

from stagerd.contract import commit_marker, layout
from stagerd.engine.export import build_export
from stagerd.engine.source import open_source
from tests.fidelity import harness
from tests.gloo import launch
from tests.training import peft_tokens_ranks as ranks

pytest.importorskip("peft")
pytestmark = pytest.mark.slow

# A bf16 model's float32 token rows (PEFT's default autocast) are cast as merge_and_unload() casts them.
CASES = [(False, 1, "float32"), (True, 1, "float32"), (False, 2, "float32"), (True, 1, "bfloat16")]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Every case saved in one launch (starting the ranks costs more than a save)."""
    out = tmp_path_factory.mktemp("tokens")
    launch(ranks.save, CASES, str(out), world=2, deadline_s=200)
    return out


@pytest.mark.parametrize(("tied", "adapters", "dtype"), CASES)
def test_the_merged_export_is_merge_and_unload_save_pretrained(tied, adapters, dtype, saved, tmp_path):
    d = saved / ranks.case_dir(tied, adapters, dtype)
    step = d / "root" / layout.step_dir_name(1)
    plan = commit_marker.read_marker(step).hub_plan
    assert plan is not None and plan.origin == "peft"  # merged, not the fallback to PEFT's own names
    for mode, dtype, limit in (
        ("merged", None, 1 << 40),
        ("merged_sharded", None, ranks.SHARD),
        ("merged_bf16", "BF16", 1 << 40),
    ):
        out = tmp_path / mode
        out.mkdir()
        build_export(
            open_source(step), out, dtype=dtype, keep_dtype=None, reference=None, max_shard_size=limit,
            threads=1, progress=None,
        )  # fmt: skip
        harness.assert_same_tensors(out, d / "ref" / mode)
        harness.assert_same_weight_files(out, d / "ref" / mode)
        assert (out / "config.json").read_bytes() == (d / "ref" / mode / "config.json").read_bytes()
