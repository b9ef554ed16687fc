"""Inkling2, whose checkpoint pads the vocabulary with zero rows (`Inkling2UnpadVocab` reversed on save:
`new_zeros` then `cat`), and stores its loop message queries as rows picked by a list: the daemon's
export is what `save_pretrained` writes, padded or not, kept and in bf16; `verify --against` re-derives
it from the marker, and `from_pretrained` loads it to the trained weights."""

from __future__ import annotations

import pytest
import torch

from stagerd import Stager
from stagerd.contract import commit_marker, layout
from stagerd.engine.export import export_step
from stagerd.engine.verify import verify_export
from tests.fidelity import harness
from tests.fidelity.loaded import loaded_in
from tests.fidelity.registry import cases as registry
from tests.fidelity.registry.check import build


@pytest.mark.parametrize("unpadded", [56, 64])
def test_inkling2_loop_exports_what_save_pretrained_writes_and_loads_back(tmp_path, unpadded):
    import transformers as tf

    if not hasattr(tf, "Inkling2LoopForCausalLM"):
        pytest.skip(f"transformers {tf.__version__} has no Inkling2 (the registry cases cover what it has)")

    case = registry.Case(
        "inkling2_loop_text", "Inkling2LoopForCausalLM", over=(("unpadded_vocab_size", unpadded),)
    )
    model = build(case)
    with Stager(tmp_path / "root", checkpointer="thread") as stager:
        stager.save(model.state_dict(), step=1, model=model, extras={"config.json": model.config.to_dict()})
        stager.wait()
    step = tmp_path / "root" / layout.step_dir_name(1)
    marker = commit_marker.read_marker(step)
    assert marker.hub_plan is not None and len(marker.hub_plan.zeros) == (unpadded < 64)
    kept = export_step(step).export_dir
    model.save_pretrained(tmp_path / "ref")
    harness.assert_same_tensors(kept, tmp_path / "ref")
    unembed = harness.tensors(kept)["model.llm.unembed.weight"]
    assert unembed[1] == (64, 32) and unembed[2][unpadded * 32 * 4 :] == bytes((64 - unpadded) * 32 * 4)
    verify_export(kept, against=step)  # re-derives the plan, zero fills included, from the marker
    loaded, info = tf.AutoModelForCausalLM.from_pretrained(kept, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    want = model.state_dict()
    for name, t in loaded.state_dict().items():
        assert torch.equal(t, want[name]), name
    bf16 = export_step(step, dtype="bf16").export_dir  # replaces the kept export: other options
    loaded_in(model, torch.bfloat16).save_pretrained(tmp_path / "ref_bf16")  # its router in float32
    harness.assert_same_tensors(bf16, tmp_path / "ref_bf16")
    verify_export(bf16, against=step)
