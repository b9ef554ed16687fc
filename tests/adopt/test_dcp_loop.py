"""A plain `dcp.async_save` training loop (2 gloo ranks, FSDP2, a tiny tied Llama) adopted as it is:
`stagerd watch ROOT --adopt` exports and publishes every finished step with no Stager and no marker, each
equal to `save_pretrained` of the trained weights, loadable by `from_pretrained`, the trainer's files
untouched; a writer killed before `.metadata` is never touched, one killed after it is exported."""

from __future__ import annotations

from pathlib import Path

import pytest

from stagerd.contract.layout import MANIFEST_NAME
from tests.adopt import ranks
from tests.adopt.helpers import published, tree_digest, watch_once
from tests.cli_helpers import run_cli
from tests.fidelity import harness
from tests.gloo import launch

pytestmark = pytest.mark.slow
KIND = "llama_tied"


def _killed(path: Path, when: str) -> None:
    """One writer process (forked: it inherits torch, already imported here), SIGKILLed in `finish()`."""
    import multiprocessing

    import torch.distributed.checkpoint  # noqa: F401

    p = multiprocessing.get_context("fork").Process(target=ranks.killed_writer, args=(0, str(path), when))
    p.start()
    p.join(120)
    assert p.exitcode == -9, p.exitcode


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("loop")
    root, ref = tmp / "root", tmp / "ref"
    ref.mkdir()
    launch(ranks.async_save_loop, str(root), str(ref), KIND, deadline_s=240)
    _killed(root / "step-5", "before")
    _killed(root / "step-6", "after")
    before = tree_digest(root)
    res = watch_once(root, tmp / "out", "--dtype", "bf16")
    return tmp, before, res


def test_every_finished_step_is_published_once(run):
    tmp, _, res = run
    assert res.returncode == 0, res.stdout + res.stderr
    assert "4 step(s) published, 0 not" in res.stdout
    assert sorted(p.name for p in (tmp / "out").glob("step-*")) == [f"step-0000000{s}" for s in (1, 2, 3, 6)]
    assert (tmp / "out" / "latest").read_text().strip() == "step-00000006"  # the newest step
    status = run_cli(["status", tmp / "root"])
    assert status.returncode == 0 and "4 published" in status.stdout, status.stdout


def test_the_export_is_what_save_pretrained_writes(run):
    tmp = run[0]
    step = published(tmp / "out", ranks.STEPS)
    harness.assert_same_tensors(step, tmp / "ref" / "bf16")  # names, dtypes, bytes; the tied head left out
    assert harness.config_dtype(step) == "bfloat16"
    harness.load_and_logits(step, "bfloat16")  # no missing, unexpected or mismatched key
    assert (step / MANIFEST_NAME).is_file()
    # verify --against re-derives the same plan from the trainer's checkpoint and compares every byte
    src = tmp / "root" / f"step-{ranks.STEPS}"
    res = run_cli(
        ["verify", tmp / "root" / ".stagerd" / "adopted" / src.name / "export", "--against", src, "--adopt"]
    )
    assert res.returncode == 0 and "every byte equal" in res.stdout, res.stdout + res.stderr


def test_the_trainer_files_are_untouched_and_the_export_lives_outside(run):
    tmp, before, _ = run
    assert tree_digest(tmp / "root") == before
    assert (tmp / "root" / ".stagerd" / "adopted" / f"step-{ranks.STEPS}" / "export").is_dir()
    assert not any((tmp / "root" / f"step-{s}" / "export").exists() for s in (1, 2, 3, 6))


def test_a_writer_killed_before_metadata_is_never_touched(run):
    tmp, _, res = run
    half = tmp / "root" / "step-5"
    assert any(half.glob("*.distcp")) and not (half / ".metadata").exists()
    assert not (tmp / "root" / ".stagerd" / "adopted" / "step-5").exists()
    assert not published(tmp / "out", 5).exists()
    # and the --once summary says so, once, where before it said nothing of it
    said = "1 checkpoint(s) not finished, left alone: step-5 (no --adopt preset recognises it yet"
    assert said in res.stdout and res.stderr.count(said) == 1, res.stdout + res.stderr[-3000:]


def test_a_writer_killed_after_metadata_is_whole_and_exported(run):
    import torch
    from safetensors.torch import load_file

    tmp = run[0]
    got = load_file(published(tmp / "out", 6) / "model.safetensors")
    want = ranks._tensors()["model"]
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k], want[k].to(torch.bfloat16)) for k in want)
