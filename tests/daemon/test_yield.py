"""The daemon yields the disk to a save being written in ROOT, for at most `--yield-seconds`.

The detection and the pause run here on real directories; the daemon runs as a real `stagerd watch`
process over a real DCP step, while a thread of this test writes the next step's files.
"""

from __future__ import annotations

import asyncio
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from stagerd.contract import layout
from stagerd.daemon.yielding import SavesInFlight, Yielder, writing_steps, written_within, yields_disk
from tests.daemon_helpers import (
    Appender,
    WatchProc,
    aged,
    fast_flags,
    free_port,
    is_state,
    stage_copy,
    start_watch,
    stop_cleanly,
    yield_seconds,
    yields,
)
from tests.dcp_fixtures import commit_step

OLD = time.time() - 3600


def _fresh_step(root: Path, step: int, part: str = layout.MODEL_DIR) -> Path:
    d = root / layout.step_dir_name(step)
    (d / part).mkdir(parents=True)
    (d / part / "shard.safetensors").write_bytes(b"x" * 64)
    return d


# -- detection ----------------------------------------------------------------------------------------------


def test_only_uncommitted_steps_written_just_now_count(tmp_path):
    _fresh_step(tmp_path, 1)
    commit_step(tmp_path / layout.step_dir_name(1), 1)  # committed: its save is over
    aged(_fresh_step(tmp_path, 2), OLD)  # abandoned long ago
    _fresh_step(tmp_path, 3, layout.OPTIM_DIR)
    (tmp_path / "not-a-step").mkdir()
    assert writing_steps(tmp_path) == (3,)
    aged(tmp_path / layout.step_dir_name(3), OLD)
    assert writing_steps(tmp_path) == ()
    assert SavesInFlight(tmp_path).writing(skip=3) is None


def test_a_step_being_exported_is_not_its_own_save(tmp_path):
    _fresh_step(tmp_path, 5)
    saves = SavesInFlight(tmp_path)
    assert saves.writing(skip=5) is None
    assert saves.writing(skip=4) == 5


def test_links_are_not_followed_and_a_vanished_dir_is_not_busy(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "fresh").write_bytes(b"x")  # written now, but only reached through a link
    step = tmp_path / "root" / layout.step_dir_name(7)
    step.mkdir(parents=True)
    (step / layout.MODEL_DIR).symlink_to(elsewhere, target_is_directory=True)
    aged(step, OLD)
    assert writing_steps(tmp_path / "root") == ()
    assert not written_within(tmp_path / "gone", 0, float("inf"))
    shutil.rmtree(step)
    assert writing_steps(tmp_path / "root") == ()


def test_only_file_sinks_yield():
    assert yields_disk("file:///mnt/exports") and yields_disk("/mnt/exports")
    assert not yields_disk("s3://bucket/run") and not yields_disk("hf://org/model")


def test_the_daemon_gives_exports_and_file_publishes_the_budget_and_remote_publishes_none(tmp_path):
    from stagerd.config import Settings
    from stagerd.daemon.core import Daemon

    local = (tmp_path / "sink").as_uri()
    settings = Settings(root=tmp_path, sinks=[local, "s3://bucket/run"], yield_seconds=7, metrics_port=0)
    d = Daemon(settings)
    assert d._yielder("export", 1).budget == 7
    assert d._yielder("publish", 1, local).budget == 7
    assert d._yielder("publish", 1, "s3://bucket/run").budget == 0


def test_a_budget_is_shared_by_the_tries_of_one_save_and_not_by_another(tmp_path):
    from stagerd.daemon.yielding import YieldLedger

    saves, ledger = SavesInFlight(tmp_path), YieldLedger()
    _fresh_step(tmp_path, 2)
    first = Yielder(saves, "export", 1, 0.3, lambda: False, ledger, ("export", 1, None, "save-a"))
    first()
    assert first.spent >= 0.3
    retry = Yielder(saves, "export", 1, 0.3, lambda: False, ledger, ("export", 1, None, "save-a"))
    t0 = time.monotonic()
    retry()
    assert time.monotonic() - t0 < 0.2 and retry.spent == 0
    resaved = Yielder(saves, "export", 1, 0.3, lambda: False, ledger, ("export", 1, None, "save-b"))
    resaved()
    assert resaved.spent >= 0.3
    ledger.forget(1, every_lane=True)
    again = Yielder(saves, "export", 1, 0.3, lambda: False, ledger, ("export", 1, None, "save-a"))
    again()
    assert again.spent >= 0.3


def test_a_pause_ends_at_its_budget_or_at_stop(tmp_path):
    saves = SavesInFlight(tmp_path)
    _fresh_step(tmp_path, 2)
    y = Yielder(saves, "export", 1, 0.5, lambda: False)
    t0 = time.monotonic()
    y()
    assert 0.45 <= time.monotonic() - t0 < 2.0 and 0.45 <= y.spent < 2.0
    t0 = time.monotonic()
    y()  # the budget is spent: no second wait
    assert time.monotonic() - t0 < 0.2
    stopping = Yielder(saves, "export", 1, 30.0, lambda: True)
    t0 = time.monotonic()
    stopping()
    assert time.monotonic() - t0 < 0.2


# -- the daemon ---------------------------------------------------------------------------------------------


@pytest.fixture
def staged(tmp_path, dcp_mixed2) -> Iterator[tuple[Path, Path, Appender]]:
    """ROOT with committed step 100 and step 101 being written (its model copied, its optim/ growing)."""
    src, _ = dcp_mixed2
    root = tmp_path / "root"
    root.mkdir()
    stage_copy(root, 100, src, 2)
    shutil.copytree(src, root / layout.step_dir_name(101) / layout.MODEL_DIR)
    writer = Appender(root / layout.step_dir_name(101) / layout.OPTIM_DIR / "blob")
    yield root, tmp_path / "sink", writer
    writer.stop()


async def _watch(root: Path, sink: Path, tmp_path: Path, *flags: str, port: int = 0) -> WatchProc:
    return await start_watch(
        root, "--sink", sink.as_uri(), *fast_flags(metrics_port=port), *flags, log_dir=tmp_path
    )


async def test_export_waits_until_the_save_commits(staged, tmp_path):
    root, sink, writer = staged
    w = await _watch(root, sink, tmp_path, "--yield-seconds", "30")
    try:
        rec = await w.wait_for(yields(100, "export"), timeout=60)
        assert rec["yields_to"] == 101
        await asyncio.sleep(1.5)
        assert not (root / layout.step_dir_name(100) / layout.EXPORT_DIR).exists()
        assert not any(is_state(100, "exported")(r) for r in w.records())
        writer.stop()
        commit_step(root / layout.step_dir_name(101), 2)
        committed = time.time()
        done = await w.wait_for(is_state(100, "exported"), timeout=30)
        # The marker ends the wait at once, not the mtimes going stale (3 s).
        assert done["ts"] - committed < 2.5, done["ts"] - committed
        assert done["yielded_seconds"] >= 1.5
        await w.wait_for(is_state(101, "published"), timeout=60)
    finally:
        await stop_cleanly(w)


async def test_a_save_that_never_ends_holds_export_and_publish_only_for_the_budget(staged, tmp_path):
    root, sink, _ = staged
    port = free_port()
    w = await _watch(root, sink, tmp_path, "--yield-seconds", "2", port=port)
    try:
        start = await w.wait_for(yields(100, "export"), timeout=60)
        done = await w.wait_for(is_state(100, "exported"), timeout=30)
        assert 1.9 <= done["ts"] - start["ts"] < 6.0
        await w.wait_for(yields(100, "publish"), timeout=30)
        resumed = await w.wait_for(lambda r: r.get("stage") == "publish" and "yielded_seconds" in r, 30)
        assert "budget is spent" in resumed["msg"]
        await w.wait_for(is_state(100, "published", sink.as_uri()), timeout=30)
        for stage in ("export", "publish"):
            assert 1.9 <= yield_seconds(port, stage) < 3.0
    finally:
        await stop_cleanly(w)


async def test_a_retried_export_yields_only_what_its_earlier_tries_left_of_the_budget(staged, tmp_path):
    root, sink, _ = staged
    port = free_port()
    w = await _watch(root, sink, tmp_path, "--yield-seconds", "3", port=port)
    try:
        await w.wait_for(yields(100, "export"), timeout=60)
        step = root / layout.step_dir_name(100)
        (step / layout.EXPORT_TMP_DIR).rename(step / "aside")  # its commit fails, retryably, after the pause
        failed = await w.wait_for(lambda r: r.get("step") == 100 and r.get("error_class"), timeout=30)
        assert failed["error_class"] == "OutputError", failed
        done = await w.wait_for(is_state(100, "exported"), timeout=60)
        assert done["yielded_seconds"] == 0  # the save is still being written: the budget was spent
        assert len([r for r in w.records() if yields(100, "export")(r)]) == 1
        assert 2.9 <= yield_seconds(port, "export") < 4.0
    finally:
        await stop_cleanly(w)


async def test_a_raw_publish_to_a_file_sink_yields_as_a_publish_does(staged, tmp_path):
    root, sink, _ = staged
    raw = f"raw:{sink.as_uri()}"
    w = await _watch(root, sink, tmp_path, "--yield-seconds", "1", "--publish-raw")
    try:
        rec = await w.wait_for(lambda r: yields(100, "publish")(r) and r.get("sink") == raw, timeout=30)
        assert rec["yields_to"] == 101
        await w.wait_for(is_state(100, "published", raw), timeout=60)
    finally:
        await stop_cleanly(w)


async def test_yield_seconds_0_exports_at_once(staged, tmp_path):
    root, sink, _ = staged
    w = await _watch(root, sink, tmp_path, "--yield-seconds", "0")
    try:
        await w.wait_for(is_state(100, "published", sink.as_uri()), timeout=60)
        assert not any("yields_to" in r for r in w.records())
        assert w.records() and not any("yielded_seconds" in r and r["yielded_seconds"] for r in w.records())
    finally:
        await stop_cleanly(w)
