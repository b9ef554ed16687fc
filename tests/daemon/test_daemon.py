"""`stagerd watch` end to end: real `stagerd watch` subprocesses, real DCP saves, a real file:// sink.

Every daemon here is a separate process started with `python -m stagerd.cli`; crashes are real SIGKILLs,
placed deterministically with the test-only environment variable `STAGERD_TEST_PAUSE_AT` (not a setting:
the worker sleeps inside its first progress report, i.e. with the export or the upload under way; see
`tests.cli_helpers.clean_env`).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from stagerd.contract import layout
from stagerd.daemon.journal import Journal
from tests.daemon_helpers import (
    REPO,
    clean_env,
    fast_flags,
    free_port,
    is_state,
    manifests,
    read_published,
    run_cli,
    same_bytes,
    stage_copy,
    start_watch,
    truncate_a_shard,
)
from tests.dcp_fixtures import mixed_tensors

pytestmark = pytest.mark.slow


@pytest.fixture
def model2(dcp_mixed2) -> tuple[Path, dict]:
    return dcp_mixed2


def assert_published_correctly(sink: Path, step: int, expected: dict) -> None:
    got = read_published(sink / layout.step_dir_name(step))
    assert set(got) == set(expected)
    bad = [k for k in expected if not same_bytes(got[k], expected[k])]
    assert not bad, f"step {step}: tensors differ: {bad}"


def published_events(root: Path) -> dict[tuple[int, str], int]:
    """(step, sink) -> how many times the journal recorded the lane as published."""
    j = Journal.open_readonly(root)
    try:
        out: dict[tuple[int, str], int] = {}
        for e in j.events():
            if e.sink is not None and e.to_state == "published":
                out[(e.step, e.sink)] = out.get((e.step, e.sink), 0) + 1
        return out
    finally:
        j.close()


# -- the daemon as a process ------------------------------------------------------------------------------


async def test_training_job_writes_steps_while_watch_runs(tmp_path):
    root, sink = tmp_path / "root", tmp_path / "sink"
    root.mkdir()
    port = free_port()
    # Default niceness and I/O class (checked below); a 30 s rescan, so a quick pickup proves inotify.
    w = await start_watch(
        root,
        "--sink",
        sink.as_uri(),
        "--rescan-seconds",
        "30",
        "--metrics-port",
        str(port),
        log_dir=tmp_path,
    )
    try:
        await w.wait_for(lambda r: r.get("msg", "").startswith("metrics on"))
        job = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "tests.daemon_helpers",
            "train",
            str(root),
            "--steps",
            "10",
            "20",
            "30",
            "--every",
            "0.3",
            cwd=str(REPO),
            env=clean_env(),
        )
        assert await asyncio.wait_for(job.wait(), 120) == 0
        for step in (10, 20, 30):
            await w.wait_for(is_state(step, "published"), timeout=60)

        assert sorted(manifests(sink)) == [10, 20, 30]
        for step in (10, 20, 30):
            assert_published_correctly(sink, step, {k: v for k, (v, _) in mixed_tensors(step).items()})
            cfg = json.loads((sink / layout.step_dir_name(step) / "config.json").read_text())
            # Every key kept; the dtype its files hold (most bytes F32 in a kept export) named (issue 12).
            assert cfg == {"model_type": "tiny", "step": step, "dtype": "float32"}

        j = Journal.open_readonly(root)
        try:
            rows = j.steps()
        finally:
            j.close()
        pickups = [r.export_started - r.marker_mtime for r in rows]
        assert [r.state for r in rows] == ["published"] * 3
        assert max(pickups) < 5.0, f"marker -> export start took {pickups}s with a 30 s rescan"

        # nice 10 and the idle I/O class, on by default
        from stagerd.ops.priority import get_io_class

        stat = Path(f"/proc/{w.pid}/stat").read_text().rsplit(")", 1)[1].split()
        assert int(stat[16]) == 10  # field 19 of /proc/PID/stat: nice
        assert get_io_class(w.pid) == 3

        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        assert 'stagerd_steps{state="published"} 3.0' in body
        assert "stagerd_exported_bytes_total" in body and "stagerd_disk_free_bytes" in body
        assert "stagerd_oldest_unpublished_age_seconds 0.0" in body
        health = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5).read())
        assert health["status"] == "ok" and health["steps"]["published"] == 3

        # status works while the daemon runs, read-only, without torch
        probe = (
            "import sys, json, io, contextlib\n"
            "from stagerd.cli import main\n"
            "buf = io.StringIO()\n"
            "with contextlib.redirect_stdout(buf):\n"
            f"    rc = main(['status', {str(root)!r}, '--json'])\n"
            "assert rc == 0 and 'torch' not in sys.modules, [m for m in sys.modules if 'torch' in m][:5]\n"
            "print(buf.getvalue())\n"
        )
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", probe, stdout=asyncio.subprocess.PIPE, env=clean_env(), cwd=str(REPO)
        )
        out, _ = await proc.communicate()
        assert proc.returncode == 0
        doc = json.loads(out)
        assert doc["daemon_pid"] == w.pid
        assert [s["lanes"][0]["state"] for s in doc["steps"]] == ["published"] * 3

        w.kill(signal.SIGTERM)
        assert await w.wait(30) == 0
    finally:
        if w.proc.returncode is None:
            w.kill()
            await w.wait()


async def test_second_daemon_is_refused(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    w = await start_watch(root, "--sink", (tmp_path / "s").as_uri(), *fast_flags(), log_dir=tmp_path)
    try:
        await w.wait_for(lambda r: r.get("msg", "").startswith("stagerd watching"))
        rc, _, err = await run_cli("watch", str(root), "--sink", (tmp_path / "s2").as_uri(), *fast_flags())
        assert rc == 2
        assert "LockError" in err and f"pid {w.pid}" in err
        w.kill(signal.SIGTERM)
        assert await w.wait(30) == 0
    finally:
        if w.proc.returncode is None:
            w.kill()
            await w.wait()


@pytest.mark.parametrize("where", ["export", "publish"])
async def test_sigkill_mid_way_then_restart_publishes_each_step_once(tmp_path, model2, where):
    src, full = model2
    root, sink = tmp_path / "root", tmp_path / "sink"
    root.mkdir()
    for step in (1, 2):
        stage_copy(root, step, src, 2)
    w = await start_watch(
        root,
        "--sink",
        sink.as_uri(),
        *fast_flags(),
        log_dir=tmp_path,
        env=clean_env(dict(STAGERD_TEST_PAUSE_AT=where)),
    )
    await w.wait_for(lambda r: r.get("test_pause") == where and r.get("step") == 1)
    w.kill(signal.SIGKILL)
    assert await w.wait() == -signal.SIGKILL

    j = Journal.open_readonly(root)
    try:
        if where == "export":
            assert j.step(1).state == "exporting"
            assert not (root / layout.step_dir_name(1) / "export").exists()  # never half-visible
        else:
            assert [ln.state for ln in j.lanes(1)] == ["publishing"]
    finally:
        j.close()
    assert 1 not in manifests(sink)

    rc, out, err = await run_cli("watch", str(root), "--sink", sink.as_uri(), "--once", *fast_flags())
    assert rc == 0, err
    assert "2 step(s) published, 0 not" in out
    assert sorted(manifests(sink)) == [1, 2]
    assert published_events(root) == {(1, sink.as_uri()): 1, (2, sink.as_uri()): 1}
    assert "resumed after a crash" in err
    j = Journal.open_readonly(root)
    try:
        assert any(e.message == "recovered after a crash" for e in j.events(1))
    finally:
        j.close()
    for step in (1, 2):
        assert_published_correctly(sink, step, full)
        assert not (root / layout.step_dir_name(step) / layout.EXPORT_TMP_DIR).exists()


async def test_sigterm_drains_in_flight_work_and_takes_no_new_work(tmp_path, model2):
    src, _ = model2
    root, sink = tmp_path / "root", tmp_path / "sink"
    root.mkdir()
    for step in (1, 2):
        stage_copy(root, step, src, 2)
    env = clean_env(dict(STAGERD_TEST_PAUSE_AT="export", STAGERD_TEST_PAUSE_SECONDS="1.5"))
    w = await start_watch(root, "--sink", sink.as_uri(), *fast_flags(), log_dir=tmp_path, env=env)
    await w.wait_for(lambda r: r.get("test_pause") == "export" and r.get("step") == 1)
    w.kill(signal.SIGTERM)
    assert await w.wait(30) == 0
    j = Journal.open_readonly(root)
    try:
        assert j.step(1).state == "exported"  # the export in flight finished
        assert j.step(2).state == "committed"  # nothing new started after the signal
        assert j.lanes(1)[0].state == "pending"
    finally:
        j.close()
    assert manifests(sink) == {}


async def test_sigterm_past_the_grace_period_abandons_cleanly(tmp_path, model2):
    src, full = model2
    root, sink = tmp_path / "root", tmp_path / "sink"
    root.mkdir()
    stage_copy(root, 1, src, 2)
    env = clean_env(dict(STAGERD_TEST_PAUSE_AT="publish"))
    w = await start_watch(
        root, "--sink", sink.as_uri(), "--grace-seconds", "0.5", *fast_flags(), log_dir=tmp_path, env=env
    )
    await w.wait_for(lambda r: r.get("test_pause") == "publish")
    t0 = time.monotonic()
    w.kill(signal.SIGTERM)
    assert await w.wait(30) == 0
    assert time.monotonic() - t0 < 10
    j = Journal.open_readonly(root)
    try:
        lane = j.lanes(1)[0]
        assert (lane.state, lane.attempts) == ("pending", 0)  # abandoned, and the attempt given back
        assert any(e.message == "abandoned at shutdown" for e in j.events(1))
    finally:
        j.close()
    rc, _, err = await run_cli("watch", str(root), "--sink", sink.as_uri(), "--once", *fast_flags())
    assert rc == 0, err
    assert_published_correctly(sink, 1, full)


async def test_corrupt_step_is_quarantined_while_later_steps_publish_and_retention_spares_it(
    tmp_path, model2
):
    src, full = model2
    root, sink = tmp_path / "root", tmp_path / "sink"
    root.mkdir()
    for step in (1, 2, 3, 4):
        stage_copy(root, step, src, 2)
    shard = truncate_a_shard(root / layout.step_dir_name(2))
    uncommitted = root / layout.step_dir_name(5)
    (uncommitted / "model").mkdir(parents=True)
    (uncommitted / "model" / "shard.safetensors").write_bytes(b"partial")
    old = time.time() - 86400
    os.utime(uncommitted, (old, old))

    rc, out, err = await run_cli(
        "watch", str(root), "--sink", sink.as_uri(), "--once", "--keep-last", "1", *fast_flags()
    )
    assert rc == 1, err
    assert "3 step(s) published, 1 not" in out
    assert "step 2: quarantined: ShardError" in out and shard.name in out
    assert sorted(manifests(sink)) == [1, 3, 4]
    for step in (1, 3, 4):
        assert_published_correctly(sink, step, full)
    # retention: 1 and 3 are published and older than the newest step; 2 is quarantined, so it stays
    left = sorted(p.name for p in root.iterdir() if not p.name.startswith("."))
    assert left == [layout.step_dir_name(2), layout.step_dir_name(4), layout.step_dir_name(5)]
    assert (root / layout.step_dir_name(2) / layout.MARKER_NAME).is_file()
    assert not any((root / ".stagerd" / "trash").iterdir())
    # the step without a marker was never touched
    assert sorted(p.name for p in uncommitted.rglob("*")) == ["model", "shard.safetensors"]

    rc, out, _ = await run_cli("status", str(root), "--json", "--all")
    assert rc == 0
    doc = json.loads(out)
    states = {s["step"]: (s["state"], s["error_class"]) for s in doc["steps"]}
    assert states == {
        1: ("retired", None),
        2: ("quarantined", "ShardError"),
        3: ("retired", None),
        4: ("published", None),
    }
    rc, out, _ = await run_cli("status", str(root))
    assert rc == 0 and "quarantined" in out and "ShardError" in out

    # a restart neither retries the quarantined step nor deletes it
    rc, out, _ = await run_cli(
        "watch", str(root), "--sink", sink.as_uri(), "--once", "--keep-last", "0", *fast_flags()
    )
    assert rc == 1
    assert (root / layout.step_dir_name(2)).is_dir() and not (root / layout.step_dir_name(4)).exists()


async def test_retention_never_deletes_a_step_one_sink_lacks(tmp_path, model2):
    src, _ = model2
    root, good = tmp_path / "root", tmp_path / "good"
    root.mkdir()
    (tmp_path / "bad").symlink_to(tmp_path / "mnt" / "sink")  # its filesystem is not mounted: down
    bad = (tmp_path / "bad").as_uri()
    for step in (1, 2):
        stage_copy(root, step, src, 2)
    rc, out, err = await run_cli(
        "watch",
        str(root),
        "--sink",
        good.as_uri(),
        "--sink",
        bad,
        "--once",
        "--keep-last",
        "0",
        "--max-attempts",
        "2",
        *fast_flags(),
        # and under disk pressure: every free byte counts as "low"
        env=clean_env(dict(STAGERD_RETRY_BASE_SECONDS="0.1", STAGERD_LOW_DISK_FREE_PERCENT="100")),
    )
    assert rc == 1, err
    assert "0 step(s) published, 2 not" in out and "SinkError" in out
    assert "low disk" in err
    assert sorted(manifests(good)) == [1, 2]
    for step in (1, 2):
        assert (root / layout.step_dir_name(step) / layout.MARKER_NAME).is_file()
        assert (root / layout.step_dir_name(step) / "export").is_dir()
    j = Journal.open_readonly(root)
    try:
        lanes = {(ln.step, ln.sink): (ln.state, ln.attempts) for ln in j.lanes()}
    finally:
        j.close()
    assert lanes[(1, bad)] == ("failed", 2) and lanes[(1, good.as_uri())][0] == "published"
    rc, out, _ = await run_cli("status", str(root), "--json")
    assert rc == 0 and json.loads(out)["disk"]["low"] is True
    rc, out, _ = await run_cli("status", str(root))
    assert rc == 0 and "LOW DISK" in out


async def test_once_exit_codes_and_config_errors(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    rc, out, _ = await run_cli(
        "watch", str(root), "--sink", (tmp_path / "s").as_uri(), "--once", *fast_flags()
    )
    assert rc == 0 and "0 step(s) published, 0 not" in out
    rc, _, err = await run_cli("watch", str(root), "--once", *fast_flags())
    assert rc == 2 and "ConfigError" in err and "no sink" in err
    rc, _, err = await run_cli("watch", "--sink", "file:///x", "--once", *fast_flags())
    assert rc == 2 and "no ROOT given" in err
    env = clean_env(dict(STAGERD_ROOT=str(root), STAGERD_SINKS=(tmp_path / "s").as_uri()))
    rc, out, _ = await run_cli("watch", "--once", *fast_flags(), env=env)
    assert rc == 0 and "0 step(s) published, 0 not" in out
    rc, _, err = await run_cli(
        "watch", str(tmp_path / "missing"), "--sink", "file:///x", "--once", *fast_flags()
    )
    assert rc == 2 and "ROOT does not exist" in err and f"mkdir -p {tmp_path / 'missing'}" in err, err
    (tmp_path / "bad.toml").write_text("keep_last = -1\n")
    rc, _, err = await run_cli("watch", str(root), "--config", str(tmp_path / "bad.toml"), "--once")
    assert rc == 2 and "keep_last" in err and "bad.toml" in err
    rc, _, err = await run_cli("status", str(tmp_path / "missing"))
    assert rc == 2 and "JournalError" in err
