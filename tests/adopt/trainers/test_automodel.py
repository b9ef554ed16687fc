"""`stagerd watch --adopt` on what NeMo AutoModel 0.7's checkpointer writes with
`save_consolidated: false`, driven in-process on 2 gloo CPU ranks (its recipe needs CUDA; see
automodel_run.py): `epoch_0_step_2/model/` HuggingFaceStorageWriter shards (no `.metadata`) beside
`optim/`, config.json in `model/.hf_metadata/`, finished when `.incomplete` is gone. bf16, tied
embeddings (AutoModel itself leaves `lm_head.weight` out)."""

from __future__ import annotations

import pytest

from tests.adopt.helpers import published, watch_once
from tests.adopt.trainers import checks, tiny
from tests.fidelity.harness import assert_same_tensors

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def adopted(tmp_path_factory) -> checks.Adopted:
    try:
        import nemo_automodel  # noqa: F401
    except ImportError as e:  # a missing install fails these tests, it does not skip them
        raise AssertionError(
            "nemo-automodel is not installed; the set-up installs it without its dependencies: "
            "pip install --no-deps -r tests/trainers-nodeps.txt"
        ) from e
    return checks.adopt("automodel", tmp_path_factory.mktemp("automodel"))


def test_the_checkpointer_writes_hf_shards_and_publishes_last(adopted):
    ckpt = adopted.run.checkpoint
    model = sorted(p.name for p in (ckpt / "model").iterdir())
    assert model == [
        ".hf_metadata",
        "consolidate.sh",
        "shard-00001-model-00001-of-00001.safetensors",
        "shard-00002-model-00001-of-00001.safetensors",
    ]
    assert (ckpt / "optim" / ".metadata").is_file() and not (ckpt / ".incomplete").exists()
    assert (ckpt.parent / "LATEST").resolve() == ckpt.resolve()


def test_the_export_is_what_save_pretrained_writes_and_loads(adopted):
    checks.check_published(adopted, "automodel")
    checks.check_loads(adopted, "bfloat16")


def test_a_checkpoint_still_marked_incomplete_is_not_exported(adopted):
    checks.check_unfinished_left_alone(adopted)


def test_the_trainers_checkpoints_are_untouched(adopted):
    checks.check_untouched(adopted)


def test_a_torch_save_checkpoint_is_exported_as_save_pretrained(adopted, tmp_path):
    watched = adopted.run.root.with_name(adopted.run.root.name + "-torch_save")
    assert (watched / f"epoch_0_step_{tiny.STEPS}" / "model" / ".metadata").is_file()
    res = watch_once(watched, tmp_path / "sink", "--extras", str(adopted.run.ref))
    assert "1 step(s) published, 0 not" in res.stdout + res.stderr, res.stdout + res.stderr
    assert_same_tensors(published(tmp_path / "sink", tiny.STEPS), adopted.run.ref)
