"""Signals and the daemon's own state files (issue 16's red team; issue 19, items 11 and 12).

- SIGHUP (an SSH session or terminal closing) used to kill the daemon at once (exit 129, no drain, the lane
  left `publishing`); it now stops it like SIGTERM, draining in-flight work.
- SIGTERM during start-up (recovery, the first scan) used to kill it with the default action; the handlers
  now come first, so it stops cleanly before taking work.
- Deleting ROOT/.stagerd (or the lock file alone) under a running daemon left it writing a journal nobody
  could read, healthy, and let a second daemon start beside it; it now stops with StateGoneError.
- A second daemon on the same ROOT reached through a symlink is refused by the lock.
"""

from __future__ import annotations

import shutil
import signal
from pathlib import Path

import pytest

from stagerd.contract import layout
from stagerd.daemon.journal import Journal
from tests.cli_helpers import clean_env, run_cli
from tests.daemon_helpers import WatchProc, fast_flags, stage_copy, start_watch


async def _parked_mid_publish(tmp_path: Path, model: Path, seconds: float) -> tuple[Path, WatchProc]:
    """ROOT with step 1 staged and a daemon on it whose publish is parked `seconds` inside its first
    progress report (under way); returns ROOT and the daemon."""
    root, sink = tmp_path / "root", tmp_path / "sink"
    stage_copy(root, 1, model, world=2)
    env = clean_env({"STAGERD_TEST_PAUSE_AT": "publish", "STAGERD_TEST_PAUSE_SECONDS": f"{seconds:g}"})
    w = await start_watch(root, "--sink", sink.as_uri(), *fast_flags(), log_dir=tmp_path, env=env)
    try:
        await w.wait_for(lambda r: r.get("test_pause") == "publish")
    except BaseException:
        w.kill()  # never parked: no daemon outlives the test
        raise
    return root, w


async def test_sighup_drains_like_sigterm(tmp_path, dcp_mixed2):
    root, w = await _parked_mid_publish(tmp_path, dcp_mixed2[0], 1)
    w.kill(signal.SIGHUP)
    assert await w.wait(60) == 0, w.text()[-3000:]
    assert "SIGHUP: no new work; draining" in w.text()
    journal = Journal.open_readonly(root)
    try:
        assert [ln.state for ln in journal.lanes(1)] == ["published"]  # finished, not left publishing
    finally:
        journal.close()


async def test_sigterm_during_start_up_stops_cleanly_before_any_work(tmp_path, dcp_mixed2):
    model, _ = dcp_mixed2
    root, sink = tmp_path / "root", tmp_path / "sink"
    for step in range(1, 4):
        stage_copy(root, step, model, world=2)
    w = await start_watch(root, "--sink", sink.as_uri(), *fast_flags(), log_dir=tmp_path)
    await w.wait_for(lambda r: str(r.get("msg", "")).startswith("stagerd watching"))
    w.kill(signal.SIGTERM)  # the engine is warming, recovery and the first scan are still to come
    assert await w.wait(60) == 0, w.text()[-3000:]
    assert "SIGTERM: no new work; draining" in w.text() and "stagerd stopped" in w.text()
    assert not sink.exists()  # nothing was published after the signal


@pytest.mark.parametrize("gone", ["state dir", "ROOT, recreated"])
async def test_a_deleted_state_dir_stops_the_daemon_with_a_named_error(tmp_path, dcp_mixed2, gone):
    model, _ = dcp_mixed2
    root, sink = tmp_path / "root", tmp_path / "sink"
    stage_copy(root, 1, model, world=2)
    env = clean_env({"STAGERD_DISK_CHECK_SECONDS": "0.2"})
    w = await start_watch(root, "--sink", sink.as_uri(), *fast_flags(), log_dir=tmp_path, env=env)
    await w.wait_for(lambda r: r.get("step") == 1 and r.get("state") == "published")
    if gone == "state dir":
        shutil.rmtree(root / layout.STATE_DIR)
    else:  # a cleanup script removes the whole ROOT, and the trainer recreates it for the next save
        shutil.rmtree(root)
        stage_copy(root, 1, model, world=2)
    assert await w.wait(30) == 2, w.text()[-3000:]
    assert "StateGoneError" in w.text() and "journal.sqlite was deleted" in w.text()
    # Started again, a daemon rebuilds the journal and finds the step already on the sink.
    again = run_cli(["watch", root, "--sink", sink.as_uri(), "--once", *fast_flags()])
    assert again.returncode == 0 and "1 step(s) published, 0 not" in again.stdout, again.stderr[-3000:]


async def test_a_replaced_lock_file_stops_the_daemon(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    env = clean_env({"STAGERD_DISK_CHECK_SECONDS": "0.2"})
    w = await start_watch(root, "--sink", (tmp_path / "s").as_uri(), *fast_flags(), log_dir=tmp_path, env=env)
    await w.wait_for(lambda r: str(r.get("msg", "")).startswith("stagerd watching"))
    lock = root / layout.STATE_DIR / "lock"
    lock.unlink()
    lock.write_text("")  # another file at the lock's path: a second daemon could lock it
    assert await w.wait(30) == 2, w.text()[-3000:]
    assert "StateGoneError" in w.text() and "lock was replaced by another file" in w.text()


async def test_a_second_daemon_through_a_symlinked_root_is_refused(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    (tmp_path / "alias").symlink_to(root, target_is_directory=True)
    w = await start_watch(root, "--sink", (tmp_path / "s").as_uri(), *fast_flags(), log_dir=tmp_path)
    try:
        await w.wait_for(lambda r: str(r.get("msg", "")).startswith("stagerd watching"))
        second = run_cli(["watch", tmp_path / "alias", "--sink", (tmp_path / "s").as_uri(), *fast_flags()])
        assert second.returncode == 2 and "LockError" in second.stderr, second.stderr
    finally:
        w.kill(signal.SIGTERM)
        assert await w.wait(30) == 0


async def test_sigstop_and_sigcont_mid_publish_publish_once(tmp_path, dcp_mixed2):
    import asyncio

    root, w = await _parked_mid_publish(tmp_path, dcp_mixed2[0], 0.5)
    try:
        w.kill(signal.SIGSTOP)  # a debugger, a cgroup freeze, ^Z
        await asyncio.sleep(3)
        w.kill(signal.SIGCONT)
        await w.wait_for(lambda r: r.get("step") == 1 and r.get("state") == "published")
    finally:
        w.kill(signal.SIGTERM)
        assert await w.wait(30) == 0, w.text()[-3000:]
    journal = Journal.open_readonly(root)
    try:
        published = [e for e in journal.events(1) if e.sink is not None and e.to_state == "published"]
        assert len(published) == 1
    finally:
        journal.close()


async def test_sigusr1_logs_where_each_task_and_thread_waits_and_the_daemon_goes_on(tmp_path, dcp_mixed2):
    _, w = await _parked_mid_publish(tmp_path, dcp_mixed2[0], 3)
    try:
        w.kill(signal.SIGUSR1)
        said = await w.wait_for(lambda r: str(r.get("msg", "")).startswith("stacks on SIGUSR1"))
        text = said["msg"]
        assert said["level"] == "warning", said
        # the scheduler's chain of awaits, the publish task's, and the publishing thread parked in its work
        assert "in _schedule_pass" in text and "task housekeeping:" in text, text
        assert "in _publish" in text and "in _test_pause" in text, text
        assert "thread stagerd-journal" in text and "thread MainThread:" in text, text
        await w.wait_for(lambda r: r.get("step") == 1 and r.get("state") == "published")  # it went on
    finally:
        w.kill(signal.SIGTERM)
    assert await w.wait(30) == 0, w.text()[-3000:]
