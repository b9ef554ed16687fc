"""A checkpoint the trainer saves again in place, or deletes (its rotation), while `watch --adopt` exports
it: the daemon is held at the `adopt.built` delay point (its export built, the source not yet checked),
the trainer acts, the daemon goes on. Nothing of that export is published; a checkpoint still finished is
exported again and published with what is there now, and one deleted is lost."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from stagerd.contract import layout
from tests.adopt import ranks
from tests.adopt.helpers import published, watch_once
from tests.cli_helpers import run_cli, start_cli
from tests.cmd.restore_helpers import wait_for_line
from tests.daemon_helpers import fast_flags


def _resave(ckpt: Path) -> None:
    import torch
    import torch.distributed.checkpoint as dcp

    dcp.save({"model": {"w": torch.ones(8, 4), "b": torch.ones(8)}}, checkpoint_id=str(ckpt), no_dist=True)


def _trashed(root: Path) -> list[str]:
    trash = root / layout.STATE_DIR / "trash"
    return sorted(p.name for p in trash.iterdir()) if trash.is_dir() else []


def _paused_once(root: Path, sink: Path, point: str, act: Callable[[], object]) -> tuple[int, str, str]:
    """`watch --adopt --once` held at the delay point `point` while `act` (the trainer) runs: its exit code,
    stdout and stderr."""
    go_on = root.parent / "go-on"
    args = ["watch", root, "--adopt", "--sink", f"file://{sink}", "--once", *fast_flags()]
    daemon = start_cli(args, env={"STAGERD_DELAY_AT": f"{point}:120", "STAGERD_DELAY_RELEASE": str(go_on)})
    try:
        wait_for_line(daemon, f"delay point {point}")
        act()
    finally:
        go_on.touch()
        out, err = daemon.communicate(timeout=120)
    return daemon.returncode, out, err


@pytest.mark.parametrize("change", ["resaved", "deleted"])
def test_a_checkpoint_changed_during_its_export_is_never_published_as_read(tmp_path, change):
    from safetensors.torch import load_file

    root, sink = tmp_path / "root", tmp_path / "sink"
    ckpt = root / "step-1"
    ranks.write(str(ckpt))
    act = (lambda: _resave(ckpt)) if change == "resaved" else (lambda: shutil.rmtree(ckpt))
    returncode, out, err = _paused_once(root, sink, "adopt.built", act)
    log = out + err
    adopted = root / layout.STATE_DIR / "adopted" / "step-1"
    assert not (adopted / layout.EXPORT_TMP_DIR).exists()
    if change == "deleted":  # its trainer deleted it: lost, as one deleted before its export began
        assert not published(sink, 1).exists() and "0 step(s) published" in log, log
        assert not adopted.exists() and not _trashed(root), log  # its partial export went with it
        assert returncode == 1 and "1 step(s) lost (1; 1 by this run)" in out, log
        return
    assert "SourceChangedError" in log, log
    assert returncode == 0 and "1 step(s) published, 0 not" in log, log
    got = load_file(published(sink, 1) / "model.safetensors")
    assert all(bool((t == 1).all()) for t in got.values()) and sorted(got) == ["b", "w"], got


def test_a_checkpoint_rotated_away_before_its_export_is_lost_once(tmp_path):
    """Seen finished, then deleted by the trainer's rotation (`save_total_limit`) before the export opened
    it: the log says so (not that no preset recognises the checkpoint), and the step is retired as lost:
    the run that lost it exits 1, a later run counts it apart and exits 0, and nothing sends anyone to
    `stagerd retry`, which could not mend it."""
    root, sink = tmp_path / "root", tmp_path / "sink"
    ckpt = root / "step-1"
    ranks.write(str(ckpt))
    ranks.write(str(root / "step-2"))
    returncode, out, err = _paused_once(root, sink, "adopt.open", lambda: shutil.rmtree(ckpt))
    log = out + err
    assert returncode == 1, log
    assert "the trainer deleted its checkpoint before it was exported" in err, err
    assert "save_total_limit" in err, err
    assert "--delete-adopted --keep-last N" in log and "no preset recognises" not in log, log
    assert not published(sink, 1).exists() and published(sink, 2).is_dir(), log
    assert not (root / layout.STATE_DIR / "adopted" / "step-1").exists(), log
    assert "1 step(s) published, 0 not" in out and "1 step(s) lost (1; 1 by this run)" in out, out
    assert "quarantined" not in out and "stagerd retry" not in out, out
    assert "--once: all " not in err and "--once: 1 step(s) lost" in err, err  # the log says it too
    again = watch_once(root, sink)
    assert again.returncode == 0 and "1 step(s) lost (1; 0 by this run)" in again.stdout, again.stdout
    assert "stagerd retry" not in again.stdout + again.stderr, again.stdout + again.stderr
    retry = run_cli(["retry", root, "--step", "1"])
    assert retry.returncode == 2, retry
    assert "step 1 is lost: the trainer deleted its checkpoint" in retry.stderr, retry.stderr


def test_a_step_an_earlier_run_quarantined_as_rotated_away_is_lost_at_the_next_start(tmp_path):
    """A journal that holds an adopted step quarantined because its trainer deleted the checkpoint (what
    an earlier run recorded, and reported with exit 1): the next start retires it as lost, counts it on
    its own line, not as this run's, and exits 0 with the other steps published."""
    from stagerd.daemon.journal import Journal

    root, sink = tmp_path / "root", tmp_path / "sink"
    ranks.write(str(root / "step-2"))
    adopted = root / layout.STATE_DIR / "adopted"
    (adopted / "step-1" / layout.EXPORT_TMP_DIR).mkdir(parents=True)  # the partial export it left
    (adopted / "step-1" / layout.EXPORT_TMP_DIR / "model.safetensors").write_bytes(b"half")
    j = Journal.open(root)
    try:
        j.add_step(1, root / "step-1", 1001.0, "dcp:gone")
        j.quarantine_step(1, "AdoptError", "the checkpoint was deleted before its export began")
    finally:
        j.close()
    r = watch_once(root, sink)
    assert r.returncode == 0 and published(sink, 2).is_dir(), r.stdout + r.stderr
    assert "1 step(s) published, 0 not" in r.stdout, r.stdout
    assert "1 step(s) lost (1; 0 by this run)" in r.stdout, r.stdout
    assert "stagerd retry" not in r.stdout + r.stderr, r.stdout + r.stderr
    assert sorted(p.name for p in adopted.iterdir()) == ["step-2"] and not _trashed(root), r.stderr


def test_a_root_unmounted_under_the_daemon_loses_no_step(tmp_path):
    """ROOT's filesystem unmounted under the daemon (lazily: its open journal goes on writing the old
    filesystem, while ROOT's path shows the empty mount point): every checkpoint looks deleted, yet none is
    lost. Simulated by renaming ROOT away (the daemon's open files follow it, as an unmounted filesystem's
    do) and making an empty directory at its path. The daemon says so once, names the mount, and stops
    (its journal is gone from ROOT); once mounted again, the next start exports the step."""
    root, sink = tmp_path / "root", tmp_path / "sink"
    mounted = tmp_path / "fs"  # the filesystem itself, while it is not mounted at ROOT
    ranks.write(str(root / "step-1"))

    def unmount() -> None:
        root.rename(mounted)
        root.mkdir()

    returncode, out, err = _paused_once(root, sink, "adopt.open", unmount)
    log = out + err
    assert "SourceGoneError" in err and "is ROOT's filesystem mounted?" in err, log
    assert err.count("no step is retired as lost; hint:") == 1, err
    assert "CheckpointDeleted" not in log and "lost (" not in out, log
    assert returncode != 0 and not published(sink, 1).exists(), log
    shutil.rmtree(root)  # mounted again: what was written to the mount point is hidden under it
    mounted.rename(root)
    again = watch_once(root, sink)
    assert again.returncode == 0 and published(sink, 1).is_dir(), again.stdout + again.stderr
    assert "lost" not in again.stdout, again.stdout


@pytest.mark.parametrize("export_dir", [None, "exports"])
def test_the_start_and_its_warning_tell_a_lost_step_alike(tmp_path, export_dir):
    """Two quarantined adopted steps whose checkpoints are gone: one with a whole export left (still
    published from it: not lost), one with none (lost). The start's warning of quarantined steps names the
    first alone, and the daemon retires the second alone as lost: one test for both, where the exports are
    ROOT's own and under --export-dir."""
    from stagerd.cmd.watch_hints import quarantined_steps
    from stagerd.daemon.journal import Journal

    root, sink = tmp_path / "root", tmp_path / "sink"
    exports = None if export_dir is None else tmp_path / export_dir
    flags = [] if exports is None else ["--export-dir", str(exports)]
    ranks.write(str(root / "step-2"))
    work = root / layout.STATE_DIR / "adopted" if exports is None else exports
    whole = work / "step-1" / layout.EXPORT_DIR
    whole.mkdir(parents=True)
    (whole / layout.WEIGHTS_NAME).write_bytes(b"built before the rotation")
    j = Journal.open(root)
    try:
        for step in (1, 3):
            j.add_step(step, root / f"step-{step}", 1000.0 + step, f"dcp:{step}")
            j.quarantine_step(step, "VerifyError", "refused")
    finally:
        j.close()
    assert quarantined_steps(root, [], adopted=True, export_dir=exports) == [1]
    r = watch_once(root, sink, *flags)
    assert "1 step(s) quarantined in the journal (1)" in r.stderr, r.stderr
    assert "step 1: quarantined" in r.stdout and "1 step(s) lost (3; 0 by this run)" in r.stdout, r.stdout
