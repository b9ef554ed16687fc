"""A step is its save, not only its number (issue 16): a step saved again is never silently ignored.

A run restarted from an earlier checkpoint saves the same step numbers again, with other data. Before this,
a re-save of a published and retired step was skipped: `watch --once` said "all published", the sink kept
the old bytes, `status` did not list the step, and its staged data stayed forever.
"""

from __future__ import annotations

import json
import shutil
import signal
import sqlite3
from pathlib import Path

import pytest

from stagerd.contract import layout
from stagerd.daemon.journal import Journal, LaneState, StepState, journal_path
from stagerd.errors import JournalError
from tests.cli_helpers import clean_env, run_cli
from tests.daemon_helpers import DROP_HINTS, fast_flags, stage_copy, start_watch

EXPORTED = {"seconds": 1, "export_bytes": 1, "tensor_bytes": 1, "files": 1, "skipped": False}


def _watch_once(root: Path, sink: Path, *extra: str):
    return run_cli(["watch", root, "--sink", sink.as_uri(), "--once", *fast_flags(), *extra])


def _status(root: Path) -> dict[int, dict]:
    r = run_cli(["status", root, "--json", "--all"])
    assert r.returncode == 0, r.stderr
    return {s["step"]: s for s in json.loads(r.stdout)["steps"]}


def test_a_step_saved_again_after_it_was_published_and_retired_is_a_named_conflict(tmp_path, dcp_mixed2):
    model, _ = dcp_mixed2
    root, sink = tmp_path / "root", tmp_path / "sink"
    stage_copy(root, 100, model, world=2)
    stage_copy(root, 200, model, world=2)
    first = _watch_once(root, sink, "--keep-last", "1")
    assert first.returncode == 0, first.stderr[-3000:]
    assert not (root / "step-00000100").exists()  # published, then retired by --keep-last 1
    old_manifest = (sink / "step-00000100" / layout.MANIFEST_NAME).read_bytes()

    stage_copy(root, 100, model, world=2, metadata={"restarted": True})  # the trainer saves step 100 again
    again = _watch_once(root, sink, "--keep-last", "1")
    assert again.returncode != 0
    assert "1 step(s) published, 1 NOT published" in again.stderr
    assert "StepConflictError" in again.stderr and "step 100 was saved again" in again.stderr
    status = _status(root)
    assert status[100]["state"] == "quarantined" and status[100]["error_class"] == "StepConflictError"
    assert (root / "step-00000100").is_dir()  # quarantined steps are never deleted
    assert (sink / "step-00000100" / layout.MANIFEST_NAME).read_bytes() == old_manifest  # nothing replaced

    # The operator decides for the new save: the old copy leaves the sink, then `retry` re-arms the step.
    shutil.rmtree(sink / "step-00000100")
    retried = run_cli(["retry", root, "--step", "100"])
    assert retried.returncode == 0, retried.stderr
    assert "re-armed step 100: quarantined -> committed" in retried.stdout
    final = _watch_once(root, sink)
    assert final.returncode == 0, final.stderr[-3000:]
    new_manifest = json.loads((sink / "step-00000100" / layout.MANIFEST_NAME).read_text())
    assert new_manifest != json.loads(old_manifest)
    assert _status(root)[100]["state"] == "published"


def test_a_step_saved_again_before_anything_was_published_replaces_it(tmp_path):
    journal = Journal.open(tmp_path)
    try:
        journal.add_step(7, tmp_path / "step-00000007", 1.0, "sha256:old")
        assert journal.new_save(7, tmp_path / "step-00000007", 2.0, "sha256:new", "sha256:old") == (
            StepState.COMMITTED
        )
        row = journal.step(7)
        assert row is not None and (row.marker_id, row.marker_mtime, row.attempts) == ("sha256:new", 2.0, 0)

        journal.begin_export(7)  # in flight: judged again once this attempt ends
        assert journal.new_save(7, tmp_path / "step-00000007", 3.0, "sha256:newer", "sha256:new") is None
        journal.finish_export(
            7, ["file:///s"], seconds=1, export_bytes=1, tensor_bytes=1, files=1, skipped=False
        )
        assert journal.new_save(7, tmp_path / "step-00000007", 3.0, "sha256:newer", "sha256:new") == (
            StepState.COMMITTED
        )
        assert journal.lanes(7) == []  # the old save's lanes published nothing: gone with it
    finally:
        journal.close()


def test_a_lane_that_published_the_old_save_makes_a_new_save_a_conflict(tmp_path):
    journal = Journal.open(tmp_path)
    try:
        journal.add_step(7, tmp_path / "s", 1.0, "sha256:old")
        journal.begin_export(7)
        journal.finish_export(
            7, ["a", "b"], seconds=1, export_bytes=1, tensor_bytes=1, files=1, skipped=False
        )
        journal.begin_publish(7, "a")
        assert journal.new_save(7, tmp_path / "s", 2.0, "sha256:new", "sha256:old") is None  # mid-publish
        journal.finish_publish(
            7, "a", sinks=["a", "b"], seconds=1, bytes_total=1, bytes_uploaded=1, location="a", skipped=False
        )
        assert journal.new_save(7, tmp_path / "s", 2.0, "sha256:new", "sha256:old") == StepState.QUARANTINED
        row = journal.step(7)
        assert row is not None and row.error_class == "StepConflictError"
        assert journal.retry(7) == [
            "step 7: quarantined -> committed",
            "step 7 on a: published -> pending",
        ]
        assert {ln.sink: ln.state for ln in journal.lanes(7)} == {
            "a": LaneState.PENDING,
            "b": LaneState.PENDING,
        }
    finally:
        journal.close()


def _schema_1_journal(root: Path) -> None:
    """A journal as stagerd wrote it before step identities: no marker_id column, user_version 1."""
    path = journal_path(root)
    path.parent.mkdir(parents=True)
    journal = Journal.open(root)
    journal.add_step(5, root / "step-00000005", 1.0, "sha256:x")
    journal.close()
    conn = sqlite3.connect(path)
    for sql in ("ALTER TABLE steps DROP COLUMN marker_id", *DROP_HINTS):
        conn.execute(sql)
    conn.execute("PRAGMA user_version=1")
    conn.commit()
    conn.close()


def test_a_schema_1_journal_is_upgraded_by_the_daemon_and_named_by_status(tmp_path):
    _schema_1_journal(tmp_path)
    with pytest.raises(JournalError, match="from an older stagerd; the next `stagerd watch`"):
        Journal.open_readonly(tmp_path)
    journal = Journal.open(tmp_path)
    try:
        row = journal.step(5)
        assert row is not None and row.marker_id is None and row.state is StepState.COMMITTED
    finally:
        journal.close()
    readonly = Journal.open_readonly(tmp_path)
    readonly.close()


async def test_a_step_deleted_mid_export_is_not_said_to_be_kept_on_disk(tmp_path, dcp_mixed2):
    model, _ = dcp_mixed2
    root, sink = tmp_path / "root", tmp_path / "sink"
    stage_copy(root, 1, model, world=2)
    env = clean_env({"STAGERD_TEST_PAUSE_AT": "export", "STAGERD_TEST_PAUSE_SECONDS": "1"})
    w = await start_watch(
        root, "--sink", sink.as_uri(), "--max-attempts", "1", *fast_flags(), log_dir=tmp_path, env=env
    )
    try:
        await w.wait_for(lambda r: r.get("test_pause") == "export" and r.get("step") == 1)
        shutil.rmtree(root / "step-00000001")  # an operator cleans up by hand while the export runs
        failed = await w.wait_for(lambda r: r.get("step") == 1 and r.get("state") == "quarantined")
    finally:
        w.kill(signal.SIGTERM)
        await w.wait()
    assert "kept on disk" not in failed["msg"]
    assert "its staged data is no longer in ROOT" in failed["msg"]
    assert "stagerd retry ROOT --step 1" in failed["msg"]
    assert "deleted from ROOT" in failed["hint"]


def test_a_step_saved_again_between_two_sinks_never_gives_them_different_weights(tmp_path, dcp_mixed2):
    """Issue 19, item 4: one sink has step 100, the other is down; the step is deleted and saved again with
    new data; the second sink comes back. It must not receive the new save while the first holds the old."""
    model, _ = dcp_mixed2
    root, good, down, mount = tmp_path / "root", tmp_path / "good", tmp_path / "down", tmp_path / "mnt"
    down.symlink_to(mount / "sink")  # the second sink's filesystem is not mounted: it is down
    stage_copy(root, 100, model, world=2)
    both = ["--sink", good.as_uri(), "--sink", down.as_uri(), "--once", *fast_flags()]
    first = run_cli(["watch", root, *both, "--max-attempts", "1"])
    assert first.returncode != 0 and (good / "step-00000100" / layout.MANIFEST_NAME).is_file()
    old_manifest = (good / "step-00000100" / layout.MANIFEST_NAME).read_bytes()

    shutil.rmtree(root / "step-00000100")
    stage_copy(root, 100, model, world=2, metadata={"restarted": True})
    (mount / "sink").mkdir(parents=True)  # the second sink is back
    again = run_cli(["watch", root, *both])
    assert again.returncode != 0 and "StepConflictError" in again.stderr
    assert (good / "step-00000100" / layout.MANIFEST_NAME).read_bytes() == old_manifest
    assert not (down / "step-00000100").exists()
    assert _status(root)[100]["error_class"] == "StepConflictError"


async def test_a_step_renamed_mid_export_ends_as_named_errors_for_both_names(tmp_path, dcp_mixed2):
    model, _ = dcp_mixed2
    root, sink = tmp_path / "root", tmp_path / "sink"
    stage_copy(root, 100, model, world=2)
    env = clean_env({"STAGERD_TEST_PAUSE_AT": "export", "STAGERD_TEST_PAUSE_SECONDS": "1"})
    w = await start_watch(
        root, "--sink", sink.as_uri(), "--max-attempts", "1", *fast_flags(), log_dir=tmp_path, env=env
    )
    try:
        await w.wait_for(lambda r: r.get("test_pause") == "export" and r.get("step") == 100)
        (root / "step-00000100").rename(root / "step-00000101")
        await w.wait_for(lambda r: r.get("step") == 100 and r.get("state") == "quarantined")
        renamed = await w.wait_for(lambda r: r.get("step") == 101 and r.get("state") == "quarantined")
    finally:
        w.kill(signal.SIGTERM)
        await w.wait()
    assert (
        renamed["error_class"] == "MarkerError"
        and "for step 100, but its directory is step 101" in renamed["msg"]
    )
    assert not sink.exists() or not any(p.name.startswith("step-") for p in sink.iterdir())
