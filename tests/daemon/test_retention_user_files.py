"""Retention (`--keep-last`) and a step directory holding files of the user's own beside the save: the
step goes to the trash whole, so those would go with it. It is kept, said once, until they are moved out."""

from __future__ import annotations

from pathlib import Path

from stagerd.contract import layout
from tests.cli_helpers import run_cli
from tests.daemon_helpers import fast_flags, stage_copy


def _watch_once(root: Path, sink: Path):
    return run_cli(["watch", root, "--sink", sink.as_uri(), "--once", "--keep-last", "1", *fast_flags()])


def test_retention_keeps_a_step_holding_the_users_files_until_they_are_moved_out(tmp_path, dcp_mixed2):
    """Before: `notes.txt` and `hf/` in a published step beyond --keep-last went to the trash with it."""
    model, _ = dcp_mixed2
    root, sink = tmp_path / "root", tmp_path / "sink"
    step1 = stage_copy(root, 1, model, world=2)
    (step1 / "notes.txt").write_text("lr spike at 0.9k")
    (step1 / "hf").mkdir()
    (step1 / "hf" / "config.json").write_text("{}")
    (step1 / ".stagerd.commit.json.tmp-12-34").write_text("a killed marker write's")  # ours: no reason
    step2 = stage_copy(root, 2, model, world=2)
    (step2 / ".export.options.json.tmp-5-6").write_text("ours too")
    stage_copy(root, 3, model, world=2)
    r = _watch_once(root, sink)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"step 1: staged data kept: {step1} also holds hf, notes.txt, which no save writes" in r.stderr
    assert "step 2: staged data kept" not in r.stderr
    assert (step1 / "notes.txt").read_text() == "lr spike at 0.9k" and (
        step1 / "hf" / "config.json"
    ).is_file()
    assert layout.is_committed(step1) and not step2.exists()  # a step of only our names goes as before
    trash = root / layout.STATE_DIR / "trash"
    assert not trash.exists() or not any(trash.iterdir())

    (step1 / "notes.txt").rename(tmp_path / "notes.txt")
    (step1 / "hf" / "config.json").unlink()
    (step1 / "hf").rmdir()
    r = _watch_once(root, sink)
    assert r.returncode == 0, r.stderr[-3000:]
    assert not step1.exists() and (root / layout.step_dir_name(3)).is_dir()
