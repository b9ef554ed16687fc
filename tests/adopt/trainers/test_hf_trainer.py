"""`stagerd watch --adopt` on what a real HF `Trainer` writes under Accelerate FSDP2 with
`SHARDED_STATE_DICT` (2 gloo CPU ranks; see hf_trainer.py for the one line that lets Accelerate shard on
CPU): `checkpoint-2/pytorch_model_fsdp_0/` beside `optimizer_0/`, finished by `trainer_state.json`; and on
what Accelerate's own `save_state` writes of the same model (no trainer_state.json ever comes)."""

from __future__ import annotations

import json

import pytest

from tests.adopt.helpers import published, watch_once
from tests.adopt.trainers import checks, tiny
from tests.fidelity.harness import assert_same_tensors

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def adopted(tmp_path_factory) -> checks.Adopted:
    return checks.adopt("hf_trainer", tmp_path_factory.mktemp("hf_trainer"))


def test_the_trainer_writes_a_dcp_model_beside_its_optimizer(adopted):
    ckpt = adopted.run.checkpoint
    for d in ("pytorch_model_fsdp_0", "optimizer_0"):
        assert sorted(p.name for p in (ckpt / d).iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert json.loads((ckpt / "trainer_state.json").read_text())["global_step"] == tiny.STEPS
    assert not (ckpt / "config.json").exists()  # hence --extras


def test_the_export_is_what_save_pretrained_writes_and_loads(adopted):
    checks.check_published(adopted, "hf-trainer")
    checks.check_loads(adopted, "float32")


def test_a_checkpoint_without_trainer_state_is_not_exported(adopted):
    checks.check_unfinished_left_alone(adopted)


def test_the_trainers_checkpoints_are_untouched(adopted):
    checks.check_untouched(adopted)


def test_accelerates_own_save_state_is_exported_as_save_pretrained(adopted, tmp_path):
    watched = adopted.run.root.parent / "accelerate"
    assert (watched / f"step-{tiny.STEPS}" / "random_states_1.pkl").is_file()
    res = watch_once(watched, tmp_path / "sink", "--extras", str(adopted.run.extras))
    assert "1 step(s) published, 0 not" in res.stdout + res.stderr, res.stdout + res.stderr
    assert_same_tensors(published(tmp_path / "sink", tiny.STEPS), adopted.run.ref)
