"""The trainer owns its checkpoints: `--keep-last` removes only stagerd's exports of old published steps,
unless `--delete-adopted` turns local retention of the trainer's checkpoints on; the export is refused a
place inside a checkpoint."""

from __future__ import annotations

import shutil

from tests.adopt import ranks
from tests.adopt.helpers import published, tree_digest, watch_once


def test_keep_last_deletes_a_trainers_checkpoint_only_when_asked(tmp_path):
    root = tmp_path / "root"
    ranks.write(str(root / "step-1"))
    shutil.copytree(root / "step-1", root / "step-2")
    before = tree_digest(root)
    res = watch_once(root, tmp_path / "out", "--keep-last", "1")
    assert res.returncode == 0 and "2 step(s) published" in res.stdout, res.stdout + res.stderr
    assert tree_digest(root) == before  # both checkpoints kept, byte for byte
    adopted = root / ".stagerd" / "adopted"
    assert not (adopted / "step-1").exists() and (adopted / "step-2" / "export").is_dir()

    ranks.write(str(root / "step-3"))
    res = watch_once(root, tmp_path / "out", "--keep-last", "1", "--delete-adopted")
    assert res.returncode == 0, res.stdout + res.stderr
    # step-2 was live and is now beyond keep-last: deleted; so is step-1, which the first run retired
    # without the flag (its export deleted, the checkpoint left): it is as far beyond keep-last, and published
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("step")) == ["step-3"]
    assert all(published(tmp_path / "out", s).is_dir() for s in (1, 2, 3))


def test_delete_adopted_given_later_keeps_what_a_trainer_pins_and_sends_a_new_sink_first(tmp_path):
    from stagerd.contract.step.pin import StepPin

    root, out, late = tmp_path / "root", tmp_path / "out", tmp_path / "late"
    ranks.write(str(root / "step-1"))
    shutil.copytree(root / "step-1", root / "step-2")
    assert watch_once(root, out, "--keep-last", "1").returncode == 0  # step 1 retired, its checkpoint kept
    names = lambda: sorted(p.name for p in root.iterdir() if p.name.startswith("step"))  # noqa: E731

    pin = StepPin(root, 1).hold()  # a trainer holds it (its best model)
    try:
        res = watch_once(root, out, "--keep-last", "1", "--delete-adopted")
        assert res.returncode == 0, res.stdout + res.stderr
        assert names() == ["step-1", "step-2"], res.stderr
    finally:
        pin.release()

    # a sink added since never got step 1: sent there from this checkpoint first, then deleted
    res = watch_once(root, out, "--sink", late.as_uri(), "--keep-last", "1", "--delete-adopted")
    assert res.returncode == 0, res.stdout + res.stderr
    assert names() == ["step-2"], res.stderr
    assert all(published(s, n).is_dir() for s in (out, late) for n in (1, 2))


def test_a_sink_added_later_gets_the_retired_steps_whose_checkpoints_are_still_there(tmp_path):
    root, a, b = tmp_path / "root", tmp_path / "a", tmp_path / "b"
    for n in (1, 2, 3):
        ranks.write(str(root / f"step-{n}"))
    res = watch_once(root, a, "--keep-last", "1")
    assert res.returncode == 0 and "3 step(s) published" in res.stdout, res.stdout + res.stderr
    adopted = root / ".stagerd" / "adopted"
    assert sorted(p.name for p in adopted.iterdir() if p.is_dir()) == ["step-3"]  # 1 and 2 retired
    shutil.rmtree(root / "step-1")  # the trainer's own rotation
    before = tree_digest(root)

    res = watch_once(root, a, "--sink", b.as_uri(), "--keep-last", "1")
    out = res.stdout + res.stderr
    assert res.returncode == 0, out
    assert not published(b, 1).exists() and published(b, 2).is_dir() and published(b, 3).is_dir()
    assert "exported again from the trainer's checkpoint for " + b.as_uri() in out, out
    assert out.count(f"{b.as_uri()} never got 1 step(s) (1)") == 2, out  # the --once summary's two reports
    assert (published(b, 2) / "model.safetensors").read_bytes() == (
        published(a, 2) / "model.safetensors"
    ).read_bytes()
    assert sorted(p.name for p in adopted.iterdir() if p.is_dir()) == ["step-3"]  # retired again
    assert tree_digest(root) == before

    res = watch_once(root, a, "--sink", b.as_uri(), "--keep-last", "1")
    assert res.returncode == 0 and "exported again" not in res.stdout + res.stderr, res.stdout + res.stderr


def test_a_sink_added_later_gets_only_the_retired_steps_its_retention_keeps(tmp_path):
    """A step the new sink's remote retention would delete at its next publish is not exported again to
    be sent there: with last=1,every=2 of steps 1-4, the sink gets 2 (a multiple) and 4 (the newest)."""
    root, a, b = tmp_path / "root", tmp_path / "a", tmp_path / "b"
    for n in (1, 2, 3, 4):
        ranks.write(str(root / f"step-{n}"))
    res = watch_once(root, a, "--keep-last", "1")
    assert res.returncode == 0 and "4 step(s) published" in res.stdout, res.stdout + res.stderr

    res = watch_once(
        root, a, "--sink", b.as_uri(), "--keep-last", "1", "--sink-retention", f"{b.as_uri()}=last=1,every=2"
    )
    out = res.stdout + res.stderr
    assert res.returncode == 0, out
    assert sorted(p.name for p in b.glob("step-*")) == ["step-00000002", "step-00000004"], out
    assert (
        "2 retired step(s) not exported again for it, its remote retention would not keep them (1, 3)" in out
    )
    assert out.count("exported again from the trainer's checkpoint for ") == 1, out  # step 2 alone


def test_an_export_directory_inside_a_checkpoint_is_refused(tmp_path):
    root = tmp_path / "root"
    ranks.write(str(root / "step-1"))
    res = watch_once(root, tmp_path / "out", "--export-dir", str(root / "step-1" / "hf"))
    assert res.returncode == 2 and "inside the trainer's checkpoint step-1" in res.stderr, res.stderr
    assert not (root / "step-1" / "hf").exists()


def test_two_roots_never_share_an_export_directory(tmp_path):
    """Two runs whose daemons were given one --export-dir (the work directories are named after the
    checkpoints: `step-1` in both): run B's daemon rebuilt run A's export of step 1 with B's weights, and
    A's next publish of step 1 (a sink added) sent B's weights as A's step 1."""
    import torch.distributed.checkpoint as dcp

    a, b, exports = tmp_path / "runA", tmp_path / "runB", tmp_path / "exports"
    ranks.write(str(a / "step-1"))
    state = ranks._tensors()
    state["model"]["w"] = state["model"]["w"] + 1
    dcp.save(state, checkpoint_id=str(b / "step-1"), no_dist=True)
    res = watch_once(a, tmp_path / "sinkA", "--export-dir", str(exports))
    assert res.returncode == 0, res.stdout + res.stderr
    before = tree_digest(exports)

    res = watch_once(b, tmp_path / "sinkB", "--export-dir", str(exports))
    assert res.returncode == 2, res.stdout + res.stderr
    assert "ConfigError" in res.stderr and f"holds the exports of another ROOT ({a})" in res.stderr
    assert tree_digest(exports) == before and not (tmp_path / "sinkB").exists()
    shutil.rmtree(a / ".stagerd")  # run A's state made again: the directory is still A's, by its path
    res = watch_once(a, tmp_path / "sinkA", "--export-dir", str(exports))
    assert res.returncode == 0 and "already there" in res.stderr, res.stdout + res.stderr
