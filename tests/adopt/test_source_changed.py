"""A checkpoint the trainer saves again in place, or deletes (its rotation), while `watch --adopt` exports
it: the daemon is held at the `adopt.built` delay point (its export built, the source not yet checked),
the trainer acts, the daemon goes on. Nothing of that export is published; a checkpoint still finished is
exported again and published with what is there now."""

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
    assert "SourceChangedError" in log, log
    adopted = root / layout.STATE_DIR / "adopted" / "step-1"
    assert not (adopted / layout.EXPORT_TMP_DIR).exists()
    if change == "deleted":
        assert not published(sink, 1).exists() and "0 step(s) published" in log, log
        return
    assert returncode == 0 and "1 step(s) published, 0 not" in log, log
    got = load_file(published(sink, 1) / "model.safetensors")
    assert all(bool((t == 1).all()) for t in got.values()) and sorted(got) == ["b", "w"], got


def test_a_checkpoint_rotated_away_before_its_export_is_named_so(tmp_path):
    """Seen finished, then deleted by the trainer's rotation (`save_total_limit`) before the export opened
    it: the log says so, not that no preset recognises the checkpoint."""
    root, sink = tmp_path / "root", tmp_path / "sink"
    ckpt = root / "step-1"
    ranks.write(str(ckpt))
    _, out, err = _paused_once(root, sink, "adopt.open", lambda: shutil.rmtree(ckpt))
    log = out + err
    assert "deleted before its export began" in log and "save_total_limit" in log, log
    assert "--delete-adopted --keep-last N" in log and "no preset recognises" not in log, log
    assert not published(sink, 1).exists() and "0 step(s) published" in log, log
    # the summary's hint is this case's, not its class's (before: "name the preset with --adopt PRESET")
    said = next(ln for ln in out.splitlines() if ln.strip().startswith("step 1: quarantined"))
    assert "--delete-adopted --keep-last N" in said and "name the preset" not in said, said
    # The journal keeps this case's hint: `stagerd status` prints it under the step's error within the
    # terminal, and the next run's summary says it again (before: the class's, for another case).
    status = run_cli(["status", root], env={"COLUMNS": "80"})
    assert status.returncode == 0 and all(len(ln) <= 80 for ln in status.stdout.splitlines()), status.stdout
    below = " ".join(status.stdout[status.stdout.index("errors:") :].split())
    assert "hint: " in below and "--delete-adopted --keep-last N" in below, status.stdout
    assert "name the preset" not in below, status.stdout
    again = watch_once(root, sink)
    said = next(ln for ln in again.stdout.splitlines() if ln.strip().startswith("step 1: quarantined"))
    assert "--delete-adopted --keep-last N" in said and "name the preset" not in said, said
