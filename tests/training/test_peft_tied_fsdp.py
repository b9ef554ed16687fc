"""A PEFT model of a tied Llama (`tie_word_embeddings=True`) under FSDP2 on 2 gloo ranks: its merged
export is what `save_pretrained` of `merge_and_unload()` writes, byte for byte (weights, index and
config.json), and the same as the export of the same model saved in one process. Copies of tied sides
without `ensure_weight_tying` (of both, or of the embeddings alone) export untied, config tie false; a
copy with it, and LoRA on the attention alone, export tied, config as it was. Every rank resolves the
same plan (`peft_tied_ranks`).

Before, copies of both sides under FSDP2 kept `tie_word_embeddings: true`: the tie was judged by the
weights' `data_ptr()`, which is 0 for every DTensor, so two sharded weights looked like one."""

from __future__ import annotations

import json

import pytest

from stagerd.contract import commit_marker, layout
from tests.fidelity import harness
from tests.gloo import launch
from tests.training import peft_tied_ranks as ranks

pytest.importorskip("peft")
pytestmark = pytest.mark.slow

TIED = {"copies": False, "embed-copy": False, "copy-tied": True, "attention": True}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Every case saved in one launch (starting the ranks costs more than a save)."""
    out = tmp_path_factory.mktemp("tied")
    launch(ranks.save, list(ranks.CASES), str(out), world=2, deadline_s=200)
    return out


def _export(root):
    from stagerd.engine.export import export_step

    step = root / layout.step_dir_name(1)
    plan = commit_marker.read_marker(step).hub_plan
    assert plan is not None and plan.origin == "peft"  # merged, not the fallback to PEFT's own names
    return plan, export_step(step, max_shard_size=ranks.LIMIT).export_dir


@pytest.mark.parametrize("case", list(ranks.CASES))
def test_the_fsdp2_export_is_merge_and_unload_save_pretrained(case, saved, tmp_path):
    from stagerd import Stager

    d = saved / case
    plan, out = _export(d / "root")
    ref = d / "ref"
    harness.assert_same_tensors(out, ref)
    harness.assert_same_weight_files(out, ref)
    for name in ("config.json", "generation_config.json"):
        assert (out / name).read_bytes() == (ref / name).read_bytes(), name
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is TIED[case]

    # The same model saved in one process: the same plan, the same export.
    with Stager(tmp_path / "root") as stager:
        stager.save((model := ranks.build(case)).state_dict(), 1, model=model).result()
    single, single_out = _export(tmp_path / "root")
    assert single == plan
    for f in sorted(p.name for p in ref.iterdir()):
        assert (single_out / f).read_bytes() == (out / f).read_bytes(), f
