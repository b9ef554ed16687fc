"""torchtitan 0.3's CheckpointManager (its own code, in-process on 2 gloo ranks: see titan_ranks.py for
why the model is a torchtitan-named Llama rather than torchtitan's model package) writes `step-N` folders
with async_save and a model-only last step; `watch --adopt` recognises them as torchtitan's, maps the
names and the RoPE rows to HF Llama, and publishes each: the last equal to `save_pretrained` of the
trained weights, loadable by `from_pretrained`, the trainer's folder untouched."""

from __future__ import annotations

import pytest

from tests.adopt import titan_ranks
from tests.adopt.helpers import published, tree_digest, watch_once
from tests.fidelity import harness
from tests.gloo import launch

pytestmark = pytest.mark.slow
try:
    import torchtitan  # noqa: F401
except ImportError as e:  # a missing install fails these tests, it does not skip them
    raise AssertionError(
        "torchtitan is not installed; the set-up installs it without its dependencies: "
        "pip install --no-deps -r tests/trainers-nodeps.txt"
    ) from e


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("titan")
    base, ref = tmp / "run", tmp / "ref"
    ref.mkdir()
    launch(titan_ranks.train_and_checkpoint, str(base), str(ref), deadline_s=240)
    root = base / "checkpoint"
    before = tree_digest(root)
    res = watch_once(root, tmp / "out", "--extras", str(base))
    return tmp, root, before, res


def test_every_torchtitan_step_is_published(run):
    tmp, root, _, res = run
    assert res.returncode == 0, res.stdout + res.stderr
    steps = range(1, titan_ranks.STEPS + 1)
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("step-")) == [
        f"step-{s}" for s in steps
    ]
    for s in steps:  # full saves with optimizer, scheduler and train state: only the model is exported
        names = harness.tensors(published(tmp / "out", s))
        assert "model.layers.1.self_attn.q_proj.weight" in names and len(names) == 21, sorted(names)


def test_the_last_step_is_what_save_pretrained_writes(run):
    tmp = run[0]
    last = published(tmp / "out", titan_ranks.STEPS)
    harness.assert_same_tensors(last, tmp / "ref" / "last")  # renames and RoPE rows, byte for byte
    assert harness.config_dtype(last) == titan_ranks.LAST_DTYPE
    harness.load_and_logits(last, titan_ranks.LAST_DTYPE)


def test_torchtitans_folder_is_untouched(run):
    _, root, before, _ = run
    assert tree_digest(root) == before
