"""The journal: a real SQLite file; transitions, their guards, crash recovery, and read-only access."""

from __future__ import annotations

import sqlite3
import threading

import pytest

from stagerd.daemon.journal import SCHEMA_VERSION, Journal, journal_path
from stagerd.errors import JournalError, ShardError
from tests.daemon_helpers import DROP_HINTS

A, B = "file:///a", "s3://bucket/run"


@pytest.fixture
def j(tmp_path):
    journal = Journal.open(tmp_path)
    yield journal
    journal.close()


def exported(j: Journal, step: int, sinks=(A, B)) -> None:
    j.add_step(step, f"/root/step-{step:08d}", 1000.0 + step)
    j.begin_export(step)
    j.finish_export(step, sinks, seconds=1.0, export_bytes=10, tensor_bytes=8, files=2, skipped=False)


def publish(j: Journal, step: int, sink: str, sinks=(A, B)) -> bool:
    j.begin_publish(step, sink)
    return j.finish_publish(
        step, sink, sinks=sinks, seconds=0.5, bytes_total=10, bytes_uploaded=10, location="x", skipped=False
    )


def test_file_is_wal_sqlite_under_the_state_dir(tmp_path, j):
    assert j.path == journal_path(tmp_path) == tmp_path / ".stagerd" / "journal.sqlite"
    conn = sqlite3.connect(j.path)
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    conn.close()


def test_full_lifecycle_records_every_transition(j):
    assert j.add_step(7, "/root/step-00000007", 1007.0)
    assert not j.add_step(7, "/root/step-00000007", 1007.0)  # found twice, journaled once
    assert j.begin_export(7) == 1
    j.finish_export(7, [A, B], seconds=1.5, export_bytes=100, tensor_bytes=90, files=3, skipped=False)
    assert [(ln.sink, ln.state) for ln in j.lanes(7)] == [(A, "pending"), (B, "pending")]
    assert not publish(j, 7, A)
    assert j.step(7).state == "exported"
    assert publish(j, 7, B)
    row = j.step(7)
    assert row.state == "published" and row.export_bytes == 100 and row.published_at is not None
    j.retire(7, "retention")
    assert j.step(7).state == "retired"
    trail = [(e.sink, e.from_state, e.to_state) for e in j.events(7)]
    assert trail == [
        (None, None, "committed"),
        (None, "committed", "exporting"),
        (None, "exporting", "exported"),
        (A, None, "pending"),
        (B, None, "pending"),
        (A, "pending", "publishing"),
        (A, "publishing", "published"),
        (B, "pending", "publishing"),
        (B, "publishing", "published"),
        (None, "exported", "published"),
        (None, "published", "retired"),
    ]


def test_impossible_transitions_are_refused_and_change_nothing(j):
    j.add_step(1, "/r/step-00000001", 1.0)
    with pytest.raises(JournalError, match="step 1 is committed"):
        j.finish_export(1, [A], seconds=0, export_bytes=0, tensor_bytes=0, files=0, skipped=False)
    with pytest.raises(JournalError, match="step 1 is committed"):
        j.retire(1, "no")
    with pytest.raises(JournalError, match="not in the journal"):
        j.begin_export(99)
    exported(j, 2)
    with pytest.raises(JournalError, match="expected one of"):
        j.finish_publish(
            2, A, sinks=[A], seconds=0, bytes_total=0, bytes_uploaded=0, location="", skipped=False
        )
    assert j.step(1).state == "committed" and j.step(2).state == "exported"
    assert len(j.events(1)) == 1


def test_failures_retry_then_quarantine(j):
    j.add_step(3, "/r/step-00000003", 1.0)
    j.begin_export(3)
    assert j.fail_export(3, "OutputError", "ENOSPC", next_try=50.0, quarantine=False) == "failed"
    assert j.next_export(now=49.0) is None  # not due yet
    assert j.next_export(now=50.0).step == 3
    assert j.next_retry_time([A]) == 50.0
    assert j.begin_export(3) == 2
    assert j.fail_export(3, "ShardError", "truncated", next_try=None, quarantine=True) == "quarantined"
    row = j.step(3)
    assert (row.state, row.error_class, row.attempts, row.next_try) == ("quarantined", "ShardError", 2, None)
    assert j.next_export(now=1e12) is None


def test_lanes_are_independent(j):
    exported(j, 1)
    exported(j, 2)
    j.begin_publish(1, B)
    j.fail_publish(1, B, "SinkError", "503", next_try=100.0, quarantine=False)
    # B waits for its retry; A is not held up by it
    assert j.next_publish(A, now=0).step == 1
    assert j.next_publish(B, now=0).step == 2
    assert j.next_publish(B, now=100.0).step == 1
    assert j.next_publish(A, now=0, exclude=[1]).step == 2
    assert j.lane_counts() == {(A, "pending"): 2, (B, "failed"): 1, (B, "pending"): 1}


def test_exports_come_in_step_order(j):
    for step in (30, 10, 20):
        j.add_step(step, f"/r/{step}", float(step))
    assert j.next_export(now=0).step == 10
    assert j.next_export(now=0, exclude=[10]).step == 20


def test_recover_puts_in_flight_work_back(tmp_path):
    j = Journal.open(tmp_path)
    j.add_step(1, "/r/1", 1.0)
    j.begin_export(1)
    exported(j, 2)
    j.begin_publish(2, A)
    j.close()  # the daemon "dies" here

    j = Journal.open(tmp_path)
    got = sorted((r.step, r.sink, r.attempts) for r in j.recover())
    assert got == [(1, None, 1), (2, A, 1)]
    assert j.step(1).state == "committed"
    assert {ln.sink: ln.state for ln in j.lanes(2)} == {A: "pending", B: "pending"}
    assert j.recover() == []
    assert any(e.message == "recovered after a crash" for e in j.events(1))
    j.close()


def test_abandon_gives_the_attempt_back(j):
    j.add_step(1, "/r/1", 1.0)
    j.begin_export(1)
    j.abandon(1, None, "abandoned at shutdown")
    assert (j.step(1).state, j.step(1).attempts) == ("committed", 0)
    exported(j, 2)
    j.begin_publish(2, A)
    j.abandon(2, A, "abandoned at shutdown")
    assert [(ln.state, ln.attempts) for ln in j.lanes(2) if ln.sink == A] == [("pending", 0)]


def test_a_new_sink_reopens_published_steps_that_are_still_staged(j):
    exported(j, 1, sinks=[A])
    publish(j, 1, A, sinks=[A])
    exported(j, 2, sinks=[A])
    publish(j, 2, A, sinks=[A])
    j.retire(2, "retention")
    assert j.ensure_lanes([A, B]) == [(1, B)]
    assert j.step(1).state == "exported" and j.step(2).state == "retired"
    assert publish(j, 1, B)


def test_a_retired_step_revived_for_a_new_sink_keeps_its_published_lanes(j):
    exported(j, 1, sinks=[A])
    publish(j, 1, A, sinks=[A])
    with pytest.raises(JournalError):
        j.revive(1, "not retired yet")
    j.retire(1, "retention")
    assert j.missed([A, B], 10) == {B: (1, [1])}
    j.revive(1, "for a new sink")
    row = j.step(1)
    assert row.state == "committed" and row.retired_at is None and j.missed([A, B], 10) == {}
    j.begin_export(1)
    j.finish_export(1, [A, B], seconds=1.0, export_bytes=10, tensor_bytes=8, files=2, skipped=False)
    assert {ln.sink: ln.state for ln in j.lanes(1)} == {A: "published", B: "pending"}
    assert publish(j, 1, B) and j.step(1).state == "published"


def test_a_removed_sink_completes_steps_waiting_only_for_it(j):
    exported(j, 1)
    publish(j, 1, A)
    assert j.step(1).state == "exported"
    j.ensure_lanes([A])  # B is no longer configured
    assert j.step(1).state == "published"


def test_readonly_reader_sees_commits_while_a_writer_runs(tmp_path, j):
    j.add_step(1, "/r/1", 1.0)
    reader = Journal.open_readonly(tmp_path)
    try:
        assert [r.step for r in reader.steps()] == [1]
        stop = threading.Event()

        def write() -> None:
            step = 2
            while not stop.is_set():
                j.add_step(step, f"/r/{step}", 1.0)
                step += 1

        t = threading.Thread(target=write)
        t.start()
        try:
            for _ in range(50):
                steps = [r.step for r in reader.steps()]
                assert steps == list(range(1, len(steps) + 1))  # never a torn view
        finally:
            stop.set()
            t.join()
        with pytest.raises(JournalError, match="read-only"):
            reader.add_step(100, "/r/100", 1.0)
    finally:
        reader.close()


def test_missing_newer_or_corrupt_journals_are_named_errors(tmp_path):
    with pytest.raises(JournalError, match="has not run on this ROOT"):
        Journal.open_readonly(tmp_path)
    path = journal_path(tmp_path)
    path.parent.mkdir(parents=True)
    conn = sqlite3.connect(path)
    conn.execute(f"PRAGMA user_version={SCHEMA_VERSION + 1}")
    conn.close()
    for opening in (Journal.open, Journal.open_readonly):  # the daemon, and `status`
        with pytest.raises(JournalError, match="newer stagerd") as e:
            opening(tmp_path)
        assert "pip install -U stagerd" in e.value.hint  # not "watch creates it on its first start"
    path.write_bytes(b"this is not a database" * 100)
    with pytest.raises(JournalError, match="cannot"):
        Journal.open(tmp_path)


def test_a_failures_hint_is_kept_and_a_schema_2_journal_falls_back_to_its_class(tmp_path):
    """Since schema 3 a failure keeps the hint its error gave for its own case, which `stagerd status` and
    a later `--once` summary print; a journal of schema 2 opens, its failures with no hint (their class's
    is shown), and records hints from then on."""
    from stagerd.cmd.status import collect

    j = Journal.open(tmp_path)
    exported(j, 1)
    j.begin_publish(1, A)
    j.fail_publish(1, A, "OSError", "refused", next_try=None, quarantine=True, hint="a case's own")
    j.add_step(2, "/root/step-00000002", 1.0)
    j.begin_export(2)
    j.fail_export(2, "ShardError", "torn", next_try=None, quarantine=True, hint="re-save step 2")
    assert j.step(2).error_hint == "re-save step 2"
    assert {ln.sink: ln.error_hint for ln in j.lanes(1)} == {A: "a case's own", B: None}
    j.close()
    conn = sqlite3.connect(journal_path(tmp_path))
    for sql in (*DROP_HINTS, "PRAGMA user_version=2"):
        conn.execute(sql)
    conn.commit()
    conn.close()
    # `stagerd status` while the older daemon still writes it: read as it is, no hints, the class's shown
    ro = Journal.open_readonly(tmp_path)
    try:
        assert ro.step(2).error_hint is None and ro.step(2).error_class == "ShardError"
        assert [ln.error_hint for ln in ro.lanes(1)] == [None, None]
    finally:
        ro.close()
    steps = {s["step"]: s for s in collect(tmp_path, include_retired=True)["steps"]}
    assert steps[2]["error_hint"] == ShardError.hint
    conn = sqlite3.connect(journal_path(tmp_path))
    assert conn.execute("PRAGMA user_version").fetchone()[0] == 2  # status upgrades nothing
    conn.close()

    j = Journal.open(tmp_path)
    try:
        assert j.step(2).error_hint is None and j.step(2).error_class == "ShardError"
        steps = {s["step"]: s for s in collect(tmp_path, include_retired=True)["steps"]}
        assert steps[2]["error_hint"] == ShardError.hint  # no hint recorded: the class's
        assert steps[1]["lanes"][0]["error_hint"] is None  # no hint recorded, none of its class
        j.retry(2)
        j.begin_export(2)
        j.fail_export(2, "ShardError", "torn", next_try=5.0, quarantine=False, hint="this case's")
        assert j.step(2).error_hint == "this case's"
        j.begin_export(2)
        j.finish_export(2, [A], seconds=1.0, export_bytes=1, tensor_bytes=1, files=1, skipped=False)
        assert j.step(2).error_hint is None  # the failure is over
    finally:
        j.close()
    conn = sqlite3.connect(journal_path(tmp_path))
    assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 3
    conn.close()


def test_a_damaged_or_locked_journal_says_what_to_do(tmp_path, j):
    """Not the default hint (that `stagerd watch` creates the journal): a damaged one is moved aside (the
    next start finds the steps again, and the sinks skip what they hold); a lock held by another process
    is ended."""
    from stagerd.daemon.journal.schema import journal_error

    holder = sqlite3.connect(j.path, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")  # an operator's sqlite3 shell, mid-transaction
    other = sqlite3.connect(j.path, timeout=0)
    with pytest.raises(sqlite3.OperationalError) as busy:
        other.execute("BEGIN IMMEDIATE")
    other.close()
    holder.close()
    assert "another process holds the journal's write lock" in journal_error(busy.value, j.path, "write").hint
    j.close()
    root = tmp_path / "damaged"
    journal_path(root).parent.mkdir(parents=True)
    journal_path(root).write_bytes(b"this is not a database" * 100)
    for opening in (Journal.open, Journal.open_readonly):
        with pytest.raises(JournalError) as e:
            opening(root)
        assert "move it aside" in e.value.hint, e.value.hint


def test_meta_round_trips(j):
    j.set_meta(pid=12, sinks=[A, B], keep_last=None)
    assert j.meta() == {"pid": 12, "sinks": [A, B], "keep_last": None}


def test_fleet_waits_are_kept_per_sink_and_read_both_ways(tmp_path, j):
    """The export's wait and each Hub lane's are apart: one ending leaves the others. The export's row is
    the one an older stagerd wrote and reads (`fleet_wait:N`, its suffix a step number); the lanes' rows
    are outside that prefix, so that an older `stagerd status` still reads this journal."""
    j.set_meta(sinks=[A, B])
    j.set_wait(7, "waiting for node 1 (seen: node-00000-of-00002)")
    j.set_wait(7, "waiting for node 0 to publish step 7 to the Hub sink A", A)
    j.set_wait(7, "waiting for node 0 to publish step 7 to the Hub sink B", B)
    j.set_wait(8, "waiting for node 0 to publish step 8 to the Hub sink B", B)
    j.set_wait(7, None, A)
    assert j.waits() == {
        7: {
            None: "waiting for node 1 (seen: node-00000-of-00002)",
            B: "waiting for node 0 to publish step 7 to the Hub sink B",
        },
        8: {B: "waiting for node 0 to publish step 8 to the Hub sink B"},
    }
    assert j.meta() == {"sinks": [A, B]}
    old = sqlite3.connect(j.path)  # an older stagerd's `waits()`, reading this journal
    rows = old.execute("SELECT key, value FROM meta WHERE key LIKE ?", ("fleet_wait:%",)).fetchall()
    assert {int(k[len("fleet_wait:") :]) for k, _ in rows} == {7}
    old.execute(
        "INSERT INTO meta (key, value) VALUES ('fleet_wait:9', '\"waiting for node 2\"')"
    )  # an older row
    old.commit()
    old.close()
    assert j.waits()[9] == {None: "waiting for node 2"}
    j.set_wait(7, None)
    assert 7 in j.waits() and None not in j.waits()[7]


def test_a_wait_ends_with_its_step_or_lane_quarantined_or_retired(j):
    """A fleet step a `--once` run left waiting whose directory is then removed is quarantined at the next
    start (`MissingStep`), not by its wait's end: `stagerd status` must not go on showing what it waited
    for. Likewise a lane's wait with the lane quarantined, and every wait of a retired step; a row an older
    stagerd left for such a step is not shown either."""
    j.add_step(7, "/root/step-00000007", 1.0)
    j.begin_export(7)
    j.set_wait(7, "waiting for node 1 (seen: node-00000-of-00002)")
    j.fail_export(7, "FleetWaitError", "nothing new for 600 s", next_try=None, quarantine=False)
    assert j.waits() == {7: {None: "waiting for node 1 (seen: node-00000-of-00002)"}}  # --once: shown
    j.quarantine_step(7, "MissingStep", "the step directory disappeared")
    exported(j, 8)
    j.set_wait(8, "waiting for node 0 to publish step 8 to the Hub sink A", A)
    j.set_wait(8, "waiting for node 0 to publish step 8 to the Hub sink B", B)
    j.begin_publish(8, A)
    j.fail_publish(8, A, "SinkAuthError", "denied", next_try=None, quarantine=True)
    assert j.waits() == {8: {B: "waiting for node 0 to publish step 8 to the Hub sink B"}}
    publish(j, 8, B)
    exported(j, 9, sinks=(A,))
    j.set_wait(9, "waiting for node 0 to publish step 9 to the Hub sink A", A)
    publish(j, 9, A, sinks=(A,))
    j.retire(9, "retention")
    assert j.waits() == {}
    old = sqlite3.connect(j.path)  # rows an older stagerd left behind
    old.execute("INSERT INTO meta (key, value) VALUES ('fleet_wait:7', '\"waiting for node 1\"')")
    old.execute("INSERT INTO meta (key, value) VALUES ('fleet_lane_wait:9:file:///a', '\"waiting\"')")
    old.commit()
    old.close()
    assert j.waits() == {}


def test_a_journal_that_was_never_set_up_says_so_and_the_next_start_sets_it_up(tmp_path):
    path = journal_path(tmp_path)
    path.parent.mkdir(parents=True)
    path.touch()  # what a first `watch` killed before creating the tables leaves
    with pytest.raises(JournalError, match="never set up") as info:
        Journal.open_readonly(tmp_path)
    assert "schema 0" not in str(info.value)
    j = Journal.open(tmp_path)
    assert j.add_step(1, "/r/1", 1.0)
    j.close()
    reader = Journal.open_readonly(tmp_path)
    assert [r.step for r in reader.steps()] == [1]
    reader.close()
