"""A long-running `stagerd watch` whose journal disk fills while steps are in flight or waiting.

It must not spin: one log line per backoff period, CPU near idle, /healthz 503 naming the journal; once
space is back it goes on by itself and publishes every step exactly once.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from functools import partial
from pathlib import Path

import pytest

from stagerd.contract import layout
from stagerd.daemon.journal import Journal
from stagerd.engine.verify import verify_export
from stagerd.errors import JournalFullError
from tests.daemon.fullfs import fill, full_root, remount
from tests.daemon_helpers import (
    WatchProc,
    clean_env,
    fast_flags,
    free_port,
    is_state,
    manifests,
    stage_copy,
    start_watch,
)

# -- the journal's disk filling up under a running daemon -------------------------------------------------

# Short backoffs, so a test sees several of them and the daemon resumes quickly once space is back.
BACKOFF = {"STAGERD_RETRY_BASE_SECONDS": "0.5", "STAGERD_RETRY_MAX_SECONDS": "2"}


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (fields 14 and 15 of /proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def healthz(port: int) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def journal_failures_counted(port: int) -> float:
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    key = 'stagerd_failures_total{error_class="JournalFullError",stage="journal"} '
    return sum(float(ln[len(key) :]) for ln in body.splitlines() if ln.startswith(key))


def is_journal_error(r: dict) -> bool:
    return r.get("level") == "error" and r.get("msg", "").startswith("journal: cannot")


async def assert_quiet_while_the_journal_is_full(w: WatchProc, port: int, seconds: float = 3.0) -> None:
    """Over `seconds`: a bounded number of log lines, CPU near idle, /healthz unhealthy naming the journal."""
    (first,) = [r for r in w.records() if is_journal_error(r)][:1]
    assert "JournalFullError" in first["msg"] and "the disk is full" in first["msg"], first
    assert first["hint"] == JournalFullError.hint and "free space" in first["msg"], first
    lines, cpu, t0 = len(w.text().splitlines()), cpu_seconds(w.pid), time.monotonic()
    await asyncio.sleep(seconds)
    wall, cpu = time.monotonic() - t0, cpu_seconds(w.pid) - cpu
    new = w.text().splitlines()[lines:]
    assert len(new) < 50, "\n".join(new[:60])
    assert sum('"journal: cannot' in ln for ln in new) <= 4, "\n".join(new)  # one per backoff period
    assert cpu < 0.2 * wall, f"{cpu:.2f}s of CPU in {wall:.2f}s"
    status, body = healthz(port)
    assert status == 503 and body["status"] == "journal unavailable", body
    assert body["journal_error"].startswith("JournalFullError: "), body
    assert journal_failures_counted(port) >= 1
    assert w.proc.returncode is None  # still running: it waits for space, it does not exit


def assert_each_step_published_once(root: Path, sink: Path, steps: list[int], exports: int = 1) -> None:
    """Every step exported `exports` time(s) and published exactly once, never redone, bytes verified."""
    assert sorted(manifests(sink)) == steps
    j = Journal.open_readonly(root)
    try:
        assert [(r.step, r.state, r.export_skipped) for r in j.steps()] == [
            (s, "published", 0) for s in steps
        ]
        assert all(ln.state == "published" and ln.skipped == 0 for ln in j.lanes()), j.lanes()
        for s in steps:
            moves = [(e.sink is None, e.to_state) for e in j.events(s)]
            assert moves.count((True, "exporting")) == exports, moves
            assert moves.count((False, "publishing")) == moves.count((False, "published")) == 1, moves
    finally:
        j.close()
    for s in steps:
        step = root / layout.step_dir_name(s)
        export = step / layout.EXPORT_DIR
        assert verify_export(export, step).files >= 1
        for f in (p for p in export.rglob("*") if p.is_file()):
            assert (sink / step.name / f.relative_to(export)).read_bytes() == f.read_bytes(), f


async def stop(w: WatchProc) -> None:
    if w.proc.returncode is None:
        w.kill(signal.SIGTERM)
        assert await w.wait(30) == 0, w.text()[-4000:]


async def wait_until(cond: Callable[[], bool], w: WatchProc, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline and w.proc.returncode is None, w.text()[-4000:]
        await asyncio.sleep(0.05)


@pytest.mark.slow
@pytest.mark.parametrize("where", ["export", "publish"])
async def test_a_running_daemon_waits_out_a_full_journal_disk_then_publishes_every_step_once(
    tmpfs, tmp_path, dcp_mixed, where
):
    src, _ = dcp_mixed
    root, sink = tmp_path / "root", tmp_path / "sink"
    root.mkdir()
    fs = tmpfs(8 << 20)
    (root / layout.STATE_DIR).symlink_to(fs, target_is_directory=True)
    for step in (1, 2):
        stage_copy(root, step, src, 4)
    port = free_port()
    env = clean_env(dict(STAGERD_TEST_PAUSE_AT=where, STAGERD_TEST_PAUSE_SECONDS="2", **BACKOFF))
    w = await start_watch(
        root, "--sink", sink.as_uri(), *fast_flags(metrics_port=port), log_dir=tmp_path / "log", env=env
    )
    try:
        await w.wait_for(lambda r: r.get("test_pause") == where and r.get("step") == 1)
        filler = fill(fs)  # step 1's work is under way and step 2 waits: neither can be recorded now
        stage_copy(root, 3, src, 4)  # found by the watcher, but the journal cannot take it either
        export = root / layout.step_dir_name(1) / layout.EXPORT_DIR
        done = partial(layout.export_is_whole, export)
        if where == "publish":
            done = (sink / layout.step_dir_name(1) / layout.MANIFEST_NAME).exists
        await wait_until(done, w)  # the work finished; recording it is what waits
        await w.wait_for(is_journal_error)

        await assert_quiet_while_the_journal_is_full(w, port)

        filler.unlink()  # space is back: no restart, the daemon carries on by itself
        for step in (1, 2, 3):
            await w.wait_for(is_state(step, "published"), timeout=60)
        status, body = healthz(port)
        assert status == 200 and body["status"] == "ok" and "journal_error" not in body, body
        await stop(w)
    finally:
        if w.proc.returncode is None:
            w.kill()
            await w.wait()
    text = w.text()
    assert "journal: writable again" in text
    assert "Traceback" not in text and "never retrieved" not in text, text[-4000:]
    assert "filesystem events unavailable" not in text  # a journal error is not a watch failure
    assert_each_step_published_once(root, sink, [1, 2, 3])


@pytest.mark.slow
async def test_a_retry_that_cannot_begin_on_a_full_journal_disk_backs_off(step_dir, tmpfs, tmp_path):
    state = tmpfs(8 << 20) / "state"
    root = full_root(step_dir, tmpfs, state)  # the export fails for want of space on ROOT, then is retried
    sink = tmp_path / "published"
    port = free_port()
    w = await start_watch(
        root,
        "--sink",
        sink.as_uri(),
        *fast_flags(metrics_port=port),
        log_dir=tmp_path / "log",
        # the retry is due 4 s after the failure: time enough, under load, to fill the disk before it
        env=clean_env(
            {
                **BACKOFF,
                "STAGERD_RETRY_BASE_SECONDS": "4",
                "STAGERD_RETRY_MAX_SECONDS": "4",
                "STAGERD_MAX_ATTEMPTS": "20",
            }
        ),
    )
    try:
        await w.wait_for(is_state(100, "failed"))
        filler = fill(state.parent)  # before the retry is due: beginning it cannot be recorded
        await w.wait_for(lambda r: is_journal_error(r) and "start the export of step 100" in r["msg"])

        await assert_quiet_while_the_journal_is_full(w, port)

        filler.unlink()
        remount(root, "size=64m")
        await w.wait_for(is_state(100, "published"), timeout=60)
        await stop(w)
    finally:
        if w.proc.returncode is None:
            w.kill()
            await w.wait()
    assert "Traceback" not in w.text() and "never retrieved" not in w.text()
    # The failed attempt and the one that worked; the refused beginnings recorded nothing.
    assert_each_step_published_once(root, sink, [100], exports=2)
