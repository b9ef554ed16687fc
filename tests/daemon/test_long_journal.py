"""A long-running daemon's journal: work per scan, `--once` check and `status` follows the live steps.

A run that saves every few minutes for months leaves tens of thousands of retired steps in the journal
(and a lane row per sink for each). What the daemon does over and over (the scan on every filesystem
event and rescan, the `--once` settle check, the gauges) and what `stagerd status` shows must read only
the live steps, not every step ever seen; likewise the names warned about once are forgotten when gone.
Reads are counted at the one place the journal returns rows (`JournalStore._query`).
"""

from __future__ import annotations

import asyncio
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from stagerd.cmd.status import collect
from stagerd.config import Settings
from stagerd.contract import layout
from stagerd.daemon.core import Daemon
from stagerd.daemon.journal import Journal
from stagerd.daemon.journal.store import JournalStore
from stagerd.daemon.summary import NEWEST_LISTED

RETIRED_STEPS = 20_000
SINKS = ("file:///a", "file:///b")


@pytest.fixture(scope="module")
def long_root(tmp_path_factory) -> Path:
    """ROOT with a journal of 20,000 retired steps (2 lanes each) and one live, published step."""
    root = tmp_path_factory.mktemp("long")
    j = Journal.open(root)
    now = time.time()
    live = RETIRED_STEPS
    with j._tx() as c:
        c.executemany(
            "INSERT INTO steps (step, path, state, marker_mtime, found_at, published_at, updated) "
            "VALUES (?, ?, ?, ?, ?, ?, ?)",
            [  # each published before it was retired, as the daemon records it
                (s, layout.step_dir_name(s), "retired" if s < live else "published", now, now, now, now)
                for s in range(live + 1)
            ],
        )
        c.executemany(
            "INSERT INTO lanes (step, sink, state, updated) VALUES (?, ?, 'published', ?)",
            [(s, k, now) for s in range(live + 1) for k in SINKS],
        )
    j.close()
    return root


class RowCount:
    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.rows = 0
        real = JournalStore._query

        def counted(store: JournalStore, sql: str, args=()) -> list[tuple]:
            out = real(store, sql, args)
            self.rows += len(out)
            return out

        monkeypatch.setattr(JournalStore, "_query", counted)


def _daemon(root: Path) -> Daemon:
    d = Daemon(Settings(root=str(root), sinks=[f"file://{root.parent}/sink"], once=True, metrics_port=0))
    d._journal = Journal.open(root)
    d._jpool = ThreadPoolExecutor(1)
    d._iopool = ThreadPoolExecutor(1)
    d._wake, d._housekeep, d._stop = asyncio.Event(), asyncio.Event(), asyncio.Event()
    return d


def test_scan_settle_summary_and_gauges_read_the_live_steps_not_every_step_ever(long_root, monkeypatch):
    counter = RowCount(monkeypatch)
    d = _daemon(long_root)
    read: dict[str, int] = {}

    async def each() -> None:
        jobs = (("scan", d._scan), ("settled", d._settled), ("summary", d._summary), ("gauges", d._refresh))
        for name, job in jobs:
            before = counter.rows
            await job()
            read[name] = counter.rows - before

    try:
        asyncio.run(each())
        summary = asyncio.run(d._summary())
    finally:
        d._journal.close()
    # before: the scan read all 20,001 saves; the settle check 20,001 + 40,002 lanes; the summary 60,003
    # rows, then (the retired steps' numbers alone) 20,001, every one of them named in its log line.
    assert max(read.values()) < 100, read
    assert summary.ok and summary.published_count == RETIRED_STEPS + 1  # retired steps still count
    assert summary.published == list(range(RETIRED_STEPS - NEWEST_LISTED + 1, RETIRED_STEPS + 1))


def test_status_reads_only_the_steps_it_shows(long_root, monkeypatch):
    counter = RowCount(monkeypatch)
    doc = collect(long_root, include_retired=False)
    assert [s["step"] for s in doc["steps"]] == [RETIRED_STEPS]
    assert len(doc["steps"][0]["lanes"]) == len(SINKS)
    assert counter.rows < 100, counter.rows  # before: 40,002 lanes of retired steps read and dropped
    assert doc["counts"]["retired"] == RETIRED_STEPS


def test_names_warned_about_once_are_forgotten_when_gone(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    for i in range(50):
        (root / f"step-{i}").mkdir()  # too few digits: warned about, never read
    d = _daemon(root)
    try:
        asyncio.run(d._scan())
        assert len(d._odd_names) == 50
        for i in range(50):
            (root / f"step-{i}").rmdir()
        asyncio.run(d._scan())
        assert d._odd_names == set()  # before: all 50 kept for good, one more per name ever seen
    finally:
        d._journal.close()


def test_the_scheduler_queries_run_every_second_do_not_read_every_retired_step(long_root):
    """An idle daemon's schedule pass runs each second: its queries look the live rows up by state."""
    j = Journal.open(long_root)
    ops = [0]

    def tick() -> int:
        ops[0] += 1
        return 0

    j._conn.set_progress_handler(tick, 100)  # SQLite calls it every 100 virtual machine instructions
    now = time.time()
    cost: dict[str, int] = {}
    try:
        for name, query in {
            "next_export": lambda: j.next_export(now, ()),
            "next_publish": lambda: j.next_publish(SINKS[0], now, ()),
            "next_raw": lambda: j.next_raw("raw:" + SINKS[0], now, ()),
            "next_retry_time": lambda: j.next_retry_time(SINKS),
            "lane_counts": j.lane_counts,
            "counts": j.counts,  # the gauges', every disk_check_seconds and after each publish
            "live steps": lambda: j.steps(include_retired=False),
            "live lanes": lambda: j.lanes(include_retired=False),
        }.items():
            ops[0] = 0
            query()
            cost[name] = ops[0]
    finally:
        j.close()
    # before: 600 to 9,200 ticks each (next_publish 2,400), reading all 20,001 steps or 40,002 lanes;
    # counts 1,400, walking every step's state
    assert max(cost.values()) < 10, cost


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_the_adopted_preset_cache_follows_the_checkpoints_in_root(tmp_path):
    """`--adopt` caches each checkpoint's preset by name; a trainer that rotates checkpoints away must not
    leave one entry per checkpoint ever seen."""
    import torch
    import torch.distributed.checkpoint as dcp

    root = tmp_path / "root"
    for n in (1, 2, 3):  # a plain single-process DCP save each
        dcp.save({"model.w": torch.full((4,), float(n))}, checkpoint_id=root / f"checkpoint-{n}")
    d = Daemon(
        Settings(root=str(root), sinks=[f"file://{tmp_path}/sink"], once=True, metrics_port=0, adopt="auto")
    )
    d._journal = Journal.open(root)
    d._jpool, d._iopool = ThreadPoolExecutor(1), ThreadPoolExecutor(1)
    d._wake, d._housekeep, d._stop = asyncio.Event(), asyncio.Event(), asyncio.Event()
    try:
        assert asyncio.run(d._scan()) == 3
        assert sorted(d._adopt_presets) == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]
        shutil.rmtree(root / "checkpoint-1")
        shutil.rmtree(root / "checkpoint-2")
        asyncio.run(d._scan())
        assert sorted(d._adopt_presets) == ["checkpoint-3"]  # before: all three kept for good
    finally:
        d._journal.close()


def test_a_quarantined_lane_does_not_keep_its_steps_marker_metadata(tmp_path):
    """The marker's metadata is cached per step until every lane has published it; a lane quarantined for
    good never does: before, each such step kept its entry for the daemon's life."""
    from stagerd.errors import VerifyError

    root = tmp_path / "root"
    root.mkdir()
    d = _daemon(root)
    sink = next(iter(d.settings.sinks))
    j = d._journal
    try:
        for step in (1, 2):
            j.add_step(step, root / layout.step_dir_name(step), 1.0, "sha256:x")
            j.begin_export(step)
            j.finish_export(step, [sink], seconds=1, export_bytes=1, tensor_bytes=1, files=1, skipped=False)
            j.begin_publish(step, sink)
            d._marker_metadata[step] = {"run": "r"}
            asyncio.run(d._work_failed(step, sink, 1, VerifyError("torn upload", path=root)))
        assert d._marker_metadata == {}
    finally:
        j.close()


def test_the_once_summary_line_names_the_newest_steps_not_every_one(long_root, caplog):
    """`--once`'s last line, as JSON: before, it listed every published step, 20,001 numbers (~140 KB)."""
    from stagerd.ops.logs import JsonFormatter

    d = _daemon(long_root)
    try:
        summary = asyncio.run(d._summary())
    finally:
        d._journal.close()
    with caplog.at_level("INFO", logger="stagerd"):
        assert d._report(summary) == 0
    line = JsonFormatter().format(caplog.records[-1])
    assert len(line) < 500, len(line)
    assert f"all {RETIRED_STEPS + 1} step(s) published (newest {NEWEST_LISTED} published: " in line
    assert f"{RETIRED_STEPS - 1}, {RETIRED_STEPS})" in line


def _run_steps(j: Journal, root: Path, steps: range, sinks: tuple[str, ...]) -> None:
    """Each step's whole life as a daemon journals it: found, exported, published on each sink, retired."""
    for s in steps:
        j.add_step(s, root / layout.step_dir_name(s), 1.0, f"sha256:{s}")
        j.begin_export(s)
        j.finish_export(s, sinks, seconds=1, export_bytes=1, tensor_bytes=1, files=1, skipped=False)
        for k in sinks:
            j.begin_publish(s, k)
            j.finish_publish(
                s,
                k,
                sinks=sinks,
                seconds=1,
                bytes_total=1,
                bytes_uploaded=1,
                location=f"{k}/{s}",
                skipped=False,
            )
        j.retire(s, "retention: keep_last=1")


def test_retired_steps_history_is_kept_for_the_newest_ones_only(tmp_path, monkeypatch):
    """The events and lanes of a retired step go once RETIRED_WITH_HISTORY newer steps are retired; a live
    step keeps all of its own, however old; `status` shows live steps as before."""
    import stagerd.daemon.journal.store as store

    RETIRED_WITH_HISTORY = 100  # 1,000 in use: fewer steps to run through here
    monkeypatch.setattr(store, "RETIRED_WITH_HISTORY", RETIRED_WITH_HISTORY)
    j = Journal.open(tmp_path)
    try:
        j.add_step(0, tmp_path / layout.step_dir_name(0), 1.0, "sha256:0")
        j.quarantine_step(0, "MarkerError", "bad marker")  # live for good, older than everything retired
        _run_steps(j, tmp_path, range(1, 2 * RETIRED_WITH_HISTORY + 51), SINKS)
        j.add_step(10_000, tmp_path / layout.step_dir_name(10_000), 1.0, "sha256:live")
        j.begin_export(10_000)
        j.finish_export(10_000, SINKS, seconds=1, export_bytes=1, tensor_bytes=1, files=1, skipped=False)
        retired = [r.step for r in j.steps() if r.state == "retired"]
        kept = set(retired[-RETIRED_WITH_HISTORY:]) | {0, 10_000}
        # before: every event (11 per step) and every lane of all 250 retired steps stayed for good
        assert {e.step for e in j.events()} == kept
        assert {ln.step for ln in j.lanes()} == kept - {0}
        assert len(j.events(retired[-1])) == 11 and [e.to_state for e in j.events(0)] == [
            "committed",
            "quarantined",
        ]
        assert len(j.steps()) == len(retired) + 2  # every step's own row stays: a save again is checked
        assert j.step(retired[0]) is not None and j.step(retired[0]).marker_id == f"sha256:{retired[0]}"
    finally:
        j.close()
    doc = collect(tmp_path, include_retired=False)
    assert [s["step"] for s in doc["steps"]] == [0, 10_000]
    assert [ln["sink"] for ln in doc["steps"][1]["lanes"]] == list(SINKS)
    assert doc["counts"]["retired"] == 2 * RETIRED_WITH_HISTORY + 50


def test_step_counts_follow_every_move_and_an_older_journal_gets_them_at_open(tmp_path):
    """The per-state counts the triggers keep equal a count of the rows, through every kind of move, and a
    journal from before them (no table, no triggers) is read as before, then counted at the next open."""
    import sqlite3

    from stagerd.daemon.journal import journal_path

    def by_rows() -> dict[str, int]:
        with sqlite3.connect(journal_path(tmp_path)) as c:
            return dict(c.execute("SELECT state, COUNT(*) FROM steps GROUP BY state").fetchall())

    j = Journal.open(tmp_path)
    try:
        _run_steps(j, tmp_path, range(1, 4), SINKS)
        j.add_step(5, tmp_path / layout.step_dir_name(5), 1.0, "sha256:5")
        j.begin_export(5)
        j.fail_export(5, "SinkError", "down", next_try=1.0, quarantine=False)
        j.new_save(3, tmp_path / layout.step_dir_name(3), 2.0, "sha256:again", "sha256:3")  # -> quarantined
        j.record_restored(7, tmp_path / layout.step_dir_name(7), "sha256:7", "file:///x")
        assert (
            {k: n for k, n in j.counts().items() if n}
            == by_rows()
            == {
                "retired": 3,
                "failed": 1,
                "quarantined": 1,
            }
        )
    finally:
        j.close()
    with sqlite3.connect(journal_path(tmp_path)) as c:  # as a stagerd from before the counts left it
        for trigger in ("insert", "delete", "update"):
            c.execute(f"DROP TRIGGER step_counts_{trigger}")
        c.execute("DROP TABLE step_counts")
        c.execute("UPDATE steps SET state = 'committed' WHERE step = 5")
    assert collect(tmp_path, include_retired=False)["counts"]["committed"] == 1
    j = Journal.open(tmp_path)
    try:
        assert {k: n for k, n in j.counts().items() if n} == by_rows()
        assert j.counts()["committed"] == 1 and j.retired_summary(2) == (2, [1, 2])
        assert j.retired_summary(2, restored=True) == (1, [7])  # landed by a restore, not published
    finally:
        j.close()


def test_the_wal_shrinks_back_after_a_big_transaction(tmp_path):
    """An older journal's first pruning is one big transaction; its WAL must not stay that size for good."""
    from stagerd.daemon.journal.schema import WAL_SIZE_LIMIT

    j = Journal.open(tmp_path)
    wal = j.path.with_name(j.path.name + "-wal")
    try:
        with j._tx() as c:  # about 10 MiB of WAL
            c.executemany(
                "INSERT INTO events (ts, step, to_state, message) VALUES (0, ?, 'committed', ?)",
                [(s, "x" * 200) for s in range(40_000)],
            )
        assert wal.stat().st_size > 2 * WAL_SIZE_LIMIT
        j._conn.execute("PRAGMA wal_checkpoint(PASSIVE)")  # what SQLite's autocheckpoint does
        j.set_meta(after=1)  # the next write starts the WAL over
        assert wal.stat().st_size <= WAL_SIZE_LIMIT  # before: 10 MiB for the life of the daemon
    finally:
        j.close()


def test_a_steps_life_costs_the_same_on_a_long_journal(long_root, tmp_path):
    """Found, exported and published on two sinks, on a copy of the 20,000-step journal: every transaction
    looks the step up by its key. Before, a publish's check of the step's other lanes went down the state
    index through every published lane ever (40,002 here; 0.1 s per step at 100,000 steps)."""
    from stagerd.daemon.journal import journal_path

    journal_path(tmp_path).parent.mkdir()
    shutil.copyfile(journal_path(long_root), journal_path(tmp_path))
    j = Journal.open(tmp_path)
    ops = [0]

    def tick() -> int:
        ops[0] += 1
        return 0

    j._conn.set_progress_handler(tick, 100)
    s = RETIRED_STEPS + 1
    try:
        j.add_step(s, tmp_path / layout.step_dir_name(s), 1.0, "sha256:new")
        j.begin_export(s)
        j.finish_export(s, SINKS, seconds=1, export_bytes=1, tensor_bytes=1, files=1, skipped=False)
        for k in SINKS:
            j.begin_publish(s, k)
            j.finish_publish(
                s, k, sinks=SINKS, seconds=1, bytes_total=1, bytes_uploaded=1, location="x", skipped=False
            )
        assert j.step(s).state == "published"
    finally:
        j.close()
    assert ops[0] < 100, ops[0]  # before: 4,005 (two publishes' checks of 40,002 lanes)
