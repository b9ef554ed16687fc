"""`StagerdCallback` in the real Hugging Face Trainer and TRL's SFTTrainer under Accelerate FSDP2, on 2 gloo
ranks (Accelerate enables FSDP only on accelerators; one line tells it the CPU run is one, see
`hf_ranks.fsdp_on_cpu`). One launch runs both trainers (`hf_ranks`): an uninterrupted run, and a run
resumed from its step 2 alone.

- the resumed run's losses and final weights are the uninterrupted run's, bit for bit;
- `stagerd watch --once` exports and publishes every step, and each export is what `save_pretrained`
  writes of that step's weights, with config, generation config and tokenizer beside it;
- nothing is written under the Trainer's output_dir (its save is skipped);
- a tiny DeepSeek V3 trained in float32 with `dtype="bf16"`: the export is `save_pretrained` of the
  model `from_pretrained(dtype=bfloat16)` loads from its float32 save, router kept in float32 (the plan's
  uncast names are of the unsharded model, its state dict DTensors);
- with `load_best_model_at_end`, under FSDP2 and DDP, the model ends with the best step's weights, loaded
  from ROOT, as the plain Trainer's does from its own checkpoint (`hf_best_ranks`).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stagerd.contract import commit_marker, layout
from tests.fidelity import harness
from tests.gloo import launch
from tests.integrations import hf_best_ranks, hf_ranks

pytestmark = pytest.mark.slow
KINDS = ["trainer", "sft"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("hf")
    launch(hf_ranks.run, [*KINDS, "moe", "best"], str(out), deadline_s=400)
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_a_resumed_run_is_the_uninterrupted_run_bit_for_bit(runs, kind):
    result = json.loads((runs / kind / "result.json").read_text())
    assert result["resumed"] == result["full"]  # steps 3 and 4 trained after the resume, equal floats
    assert list(result["full"]) == ["1", "2", "3", "4"]
    assert result["same_weights"]
    assert result["sharded"] == [True, True]  # Accelerate's FSDP2, not DDP
    assert result["attached"] == [True, True]  # the optimizer's step waits for the copy (Stager.attach)
    assert not list((runs / kind / "output").glob("checkpoint-*"))  # the Trainer's own save: skipped


@pytest.mark.parametrize("kind", KINDS)
def test_the_daemon_exports_every_step_as_save_pretrained(runs, kind):
    root = runs / kind / "full"
    sink = runs / kind / "sink"
    harness.export(root, sink)  # stagerd watch ROOT --sink file://SINK --once, every step published
    for step in range(hf_ranks.EVERY, hf_ranks.STEPS + 1, hf_ranks.EVERY):
        published = sink / layout.step_dir_name(step)
        ref = runs / kind / "ref" / f"step-{step}"
        harness.assert_same_tensors(published, ref)  # the tied lm_head left out, as save_pretrained does
        for name in ("config.json", "generation_config.json"):
            assert json.loads((published / name).read_text()) == json.loads((ref / name).read_text())
        assert (published / "tokenizer.json").is_file()
    state = json.loads((sink / layout.step_dir_name(hf_ranks.STEPS) / "trainer_state.json").read_text())
    assert state["global_step"] == hf_ranks.STEPS


def test_a_bf16_export_of_a_moe_keeps_its_router_as_from_pretrained_does(runs):
    run = runs / "moe"
    assert json.loads((run / "result.json").read_text())["sharded"]
    harness.export(run / "root", run / "sink")
    published = run / "sink" / layout.step_dir_name(hf_ranks.EVERY)
    harness.assert_same_weight_files(published, run / "ref")
    assert (published / "config.json").read_bytes() == (run / "ref" / "config.json").read_bytes()
    f32 = sorted(n for n, (dt, _, _) in harness.tensors(published).items() if dt == "F32")
    assert f32 == ["model.layers.1.mlp.gate.e_score_correction_bias", "model.layers.1.mlp.gate.weight"]
    plan = commit_marker.read_marker(run / "root" / layout.step_dir_name(hf_ranks.EVERY)).hub_plan
    assert plan is not None and sorted(plan.uncast_for("BF16")) == f32  # the unsharded model's names
    assert plan.dtype_from is None  # its first parameter, the embeddings, is cast


@pytest.mark.parametrize("mode", hf_best_ranks.MODES)
def test_load_best_model_at_end_loads_the_best_staged_step_as_the_trainer_does(runs, mode):
    result = json.loads((runs / "best" / f"best-{mode}.json").read_text())
    assert result["best_global_step"] == result["plain_best_global_step"] == 1  # of 2: not the last
    assert result["final_is_best"] == [True, True]  # bit for bit, on each rank
    assert result["final_is_last"] == [False, False]
    assert result["final_is_plain"] == [True, True]  # what the plain Trainer ends with, from its checkpoint
    best = (runs / "best" / mode / "root" / layout.step_dir_name(1)).resolve()
    for key in ("best_model_checkpoint", "recorded_in_the_best_step", "recorded_in_the_last_step"):
        assert Path(result[key]).resolve() == best, key  # a path a user can load, in trainer_state.json too
    assert result["sharded"] == (mode == "fsdp2")
    assert result["output"] == []  # nothing under output_dir
