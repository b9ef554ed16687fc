"""Retention: which published steps go, the low-disk thresholds, and the trash that makes deleting a step
atomic (a step is renamed into ROOT/.stagerd/trash, then removed; a crash in between leaves only trash)."""

from __future__ import annotations

import contextlib
import os
import shutil

import pytest

from stagerd.contract import layout
from stagerd.daemon.retention import (
    StepView,
    disk_state,
    empty_trash,
    move_to_trash,
    plan_retention,
    trash_dir,
)
from stagerd.errors import SymlinkError


def test_retention_plan_keeps_newest_and_never_unpublished():
    steps = [StepView(1, True), StepView(2, False), StepView(3, True), StepView(4, True), StepView(5, False)]
    assert plan_retention(steps, None) == []
    assert plan_retention(steps, 2) == [1, 3]
    assert plan_retention(steps, 0) == [1, 3, 4]
    assert plan_retention(steps, 5) == []
    assert plan_retention([StepView(9, False)] * 3, 0) == []


def test_disk_state_thresholds(tmp_path):
    assert disk_state(tmp_path, low_percent=100.0, low_bytes=0).low
    assert not disk_state(tmp_path, low_percent=0.0, low_bytes=0).low
    assert disk_state(tmp_path, low_percent=0.0, low_bytes=1 << 62).low


def test_move_to_trash_takes_the_step_out_of_root_in_one_rename(tmp_path):
    step = tmp_path / layout.step_dir_name(3)
    (step / "model").mkdir(parents=True)
    (step / "model" / "shard").write_bytes(b"x" * 100)
    inode = os.stat(step / "model" / "shard").st_ino
    moved = move_to_trash(tmp_path, step)
    assert moved is not None and moved.parent == trash_dir(tmp_path)
    assert not step.exists()
    assert os.stat(moved / "model" / "shard").st_ino == inode  # renamed, not copied
    assert move_to_trash(tmp_path, step) is None  # already gone: nothing to do


def test_empty_trash_removes_directories_and_stray_files_and_counts_them(tmp_path):
    assert empty_trash(tmp_path) == 0  # no trash yet
    for n in (1, 2):
        step = tmp_path / layout.step_dir_name(n)
        (step / "model").mkdir(parents=True)
        move_to_trash(tmp_path, step)
    (trash_dir(tmp_path) / "leftover").write_bytes(b"partial")
    (tmp_path / ".step-00000004.retired.12.34").mkdir()  # set aside, then killed (another filesystem)
    (tmp_path / ".notes.retired.12.34").mkdir()  # not a step's: never stagerd's to delete
    (tmp_path / ".step-00000005.retired.12.34.bak").mkdir()
    assert empty_trash(tmp_path) == 4
    assert list(trash_dir(tmp_path).iterdir()) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".notes.retired.12.34",
        ".stagerd",
        ".step-00000005.retired.12.34.bak",
    ]


def _watch_once(root, sink, *extra):
    from tests.cli_helpers import run_cli
    from tests.daemon_helpers import fast_flags

    return run_cli(["watch", root, "--sink", sink.as_uri(), "--once", *fast_flags(), *extra])


def test_retention_never_deletes_a_step_being_saved_again(tmp_path, dcp_mixed2):
    """Step 100 was published, then deleted by hand and saved again (the run restarted from step 50): the
    new save is in ROOT, not yet committed, its Stager holding the step's lock. Retention (keep 2) used to
    rename it into the trash by the journal's word that step 100 was published: the new save was lost."""
    import shutil

    from stagerd.contract.step.lock import StepLock
    from tests.daemon_helpers import stage_copy
    from tests.dcp_fixtures import commit_step

    model, _ = dcp_mixed2
    root, sink = tmp_path / "root", tmp_path / "sink"
    stage_copy(root, 100, model, world=2)
    stage_copy(root, 200, model, world=2)
    first = _watch_once(root, sink, "--keep-last", "2")
    assert first.returncode == 0, first.stderr[-3000:]

    step = root / layout.step_dir_name(100)
    shutil.rmtree(step)
    shutil.copytree(model, step / "model")  # the new save, written, its marker not yet
    stage_copy(root, 300, model, world=2)
    with StepLock(root, 100, "a Stager save"):
        second = _watch_once(root, sink, "--keep-last", "2")
        assert second.returncode == 0, second.stderr[-3000:]
        assert sorted(p.name for p in (step / "model").iterdir()) == sorted(p.name for p in model.iterdir())
        assert "step 100: staged data kept" in second.stderr
    commit_step(step, 2, metadata={"restarted": True})  # the save finishes: the scan judges it next
    assert not (root / ".stagerd" / "trash").exists() or not list((root / ".stagerd" / "trash").iterdir())


def test_a_trash_that_is_a_link_is_refused_and_its_target_untouched(tmp_path, dcp_mixed2):
    """`ROOT/.stagerd/trash` linked to another directory: the daemon emptied that directory at start (every
    entry in it, as leftovers of an interrupted retention), and renamed retired steps into it."""
    from tests.daemon_helpers import stage_copy

    model, _ = dcp_mixed2
    root, sink, other = tmp_path / "root", tmp_path / "sink", tmp_path / "datasets"
    (other / "imagenet").mkdir(parents=True)
    (other / "imagenet" / "train.bin").write_bytes(b"x" * 100)
    (other / "readme.txt").write_bytes(b"keep")
    stage_copy(root, 1, model, world=2)
    stage_copy(root, 2, model, world=2)
    trash_dir(root).parent.mkdir()
    trash_dir(root).symlink_to(other, target_is_directory=True)
    r = _watch_once(root, sink, "--keep-last", "1")
    assert r.returncode == 2, r.stderr[-3000:]
    assert "SymlinkError" in r.stderr and str(trash_dir(root)) in r.stderr
    assert sorted(p.name for p in other.iterdir()) == ["imagenet", "readme.txt"]
    assert (other / "imagenet" / "train.bin").read_bytes() == b"x" * 100
    assert layout.is_committed(root / layout.step_dir_name(1))

    with pytest.raises(SymlinkError):  # retention of a running daemon: the step stays in ROOT
        move_to_trash(root, root / layout.step_dir_name(1))
    assert layout.is_committed(root / layout.step_dir_name(1))


def test_a_trash_on_another_filesystem_never_leaves_half_a_step_in_root(tmp_path, tmpfs, dcp_mixed2):
    """`ROOT/.stagerd` linked to another disk: no rename reaches the trash (EXDEV). The step was removed in
    place, file by file, so a kill left half a step (perhaps its marker without its shards) in ROOT. Now it
    is set aside by one rename beside it first; a kill there leaves only the set-aside copy, which the
    restart removes."""
    from tests.cli_helpers import run_cli
    from tests.daemon_helpers import fast_flags, stage_copy

    model, _ = dcp_mixed2
    root, sink = tmp_path / "root", tmp_path / "sink"
    stage_copy(root, 1, model, world=2)
    stage_copy(root, 2, model, world=2)
    state = tmpfs(16 << 20)
    (root / layout.STATE_DIR).symlink_to(state, target_is_directory=True)
    args = ["watch", root, "--sink", sink.as_uri(), "--once", "--keep-last", "1", *fast_flags()]
    killed = run_cli(args, env={"STAGERD_CRASH_AT": "retention.trashed:1"})
    assert killed.returncode == -9, killed.stderr[-3000:]
    left = [p.name for p in root.iterdir()]
    assert layout.step_dir_name(1) not in left  # out of ROOT's steps whole, never half
    assert [n for n in left if n.startswith(f".{layout.step_dir_name(1)}.retired.")], left
    again = run_cli(args)
    assert again.returncode == 0, again.stderr[-3000:]
    left = sorted(p.name for p in root.iterdir() if not p.name.endswith(".lock"))  # a killed holder's lock
    assert left == [layout.STATE_DIR, layout.step_dir_name(2)]
    assert layout.is_committed(root / layout.step_dir_name(2))


def test_retention_of_a_step_replaced_by_a_link_removes_only_the_link(tmp_path):
    """A published step moved elsewhere and linked back: retention renames the link, never its target's
    files, and the trash removes the link alone (guard: this held before)."""
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "model").mkdir(parents=True)
    (elsewhere / "model" / "shard").write_bytes(b"x" * 10)
    root = tmp_path / "root"
    root.mkdir()
    (root / layout.step_dir_name(1)).symlink_to(elsewhere, target_is_directory=True)
    assert move_to_trash(root, root / layout.step_dir_name(1)) is not None
    assert empty_trash(root) == 1
    assert list(root.glob("step-*")) == [] and (elsewhere / "model" / "shard").read_bytes() == b"x" * 10


def _link_trash_away(root, victim) -> None:
    """The trash moved aside and a link to another directory put in its place, at one instant."""
    trash = trash_dir(root)
    trash.rename(trash.with_name("trash-aside"))
    trash.symlink_to(victim, target_is_directory=True)


def test_a_trash_linked_away_as_a_step_goes_into_it_takes_nothing_elsewhere(tmp_path, monkeypatch):
    """The trash checked, then swapped for a link before the step is renamed into it: the step went into
    the directory the link led to (out of ROOT and out of the trash's reach). Now the rename is made into
    the trash held open: the step is in stagerd's trash, wherever it went, and nothing in the target."""
    root, victim = tmp_path / "root", tmp_path / "datasets"
    victim.mkdir()
    step = root / layout.step_dir_name(1)
    (step / "model").mkdir(parents=True)
    move_to_trash(root, root / "absent")  # the trash exists, as after an earlier retention
    rename = os.rename

    def swap_then_rename(*args, **kwargs):
        monkeypatch.setattr(os, "rename", rename)
        _link_trash_away(root, victim)
        return rename(*args, **kwargs)

    monkeypatch.setattr(os, "rename", swap_then_rename)
    move_to_trash(root, step)
    assert list(victim.iterdir()) == []
    assert [p.name.split(".")[0] for p in (root / layout.STATE_DIR / "trash-aside").iterdir()] == [step.name]
    with pytest.raises(SymlinkError):  # the link is refused from then on, its target left as it is
        empty_trash(root)


def test_a_trash_linked_away_while_it_is_emptied_empties_nothing_elsewhere(tmp_path, monkeypatch):
    """The trash listed, then swapped for a link to a directory holding entries of the same names (a copy
    of the trash): those were deleted. Now each entry is removed from the trash held open."""
    from stagerd.daemon import retention

    root, victim = tmp_path / "root", tmp_path / "copy"
    step = root / layout.step_dir_name(1)
    (step / "model").mkdir(parents=True)
    (step / "model" / "shard").write_bytes(b"x")
    moved = move_to_trash(root, step)
    assert moved is not None
    shutil.copytree(trash_dir(root), victim)
    point = retention.crash_point

    def swap_at(name: str) -> None:
        if name == "retention.rmtree" and not trash_dir(root).is_symlink():
            _link_trash_away(root, victim)
        point(name)

    monkeypatch.setattr(retention, "crash_point", swap_at)
    assert empty_trash(root) == 1
    assert (victim / moved.name / "model" / "shard").read_bytes() == b"x"
    assert list((root / layout.STATE_DIR / "trash-aside").iterdir()) == []


def _published(journal, step: int, path, sink: str) -> None:
    journal.add_step(step, path, 0.0)
    journal.begin_export(step)
    journal.finish_export(step, [sink], seconds=0, export_bytes=0, tensor_bytes=0, files=0, skipped=False)
    journal.begin_publish(step, sink)
    journal.finish_publish(
        step, sink, sinks=[sink], seconds=0, bytes_total=0, bytes_uploaded=0, location=sink, skipped=False
    )


@contextlib.contextmanager
def _retaining_daemon(root, sink: str, dirs: dict):
    """A `--once` daemon, keep_last=1, whose journal holds `dirs`' steps published on `sink`: no watch loop,
    the test runs its retention."""
    from concurrent.futures import ThreadPoolExecutor

    from stagerd.config import Settings
    from stagerd.daemon.core import Daemon
    from stagerd.daemon.journal import Journal

    d = Daemon(Settings(root=str(root), sinks=[sink], keep_last=1, once=True, metrics_port=0))
    d._journal = Journal.open(root)
    d._jpool, d._trashpool, d._iopool = ThreadPoolExecutor(1), ThreadPoolExecutor(1), ThreadPoolExecutor(1)
    try:
        for s, path in dirs.items():
            _published(d._journal, s, path, sink)
        yield d
    finally:
        d._journal.close()
        d._jpool.shutdown()
        d._trashpool.shutdown()
        d._iopool.shutdown()


def test_a_step_moved_away_by_hand_is_not_logged_as_deleted_by_retention(tmp_path, caplog):
    """Steps 1-3 published, keep 1; an operator renamed step 1's directory and removed step 2's by hand
    while the daemon ran. Retention logged both "retired (staged data deleted)", though it deleted nothing
    (the renamed copy is still on disk): the log and the journal now say the directory was already gone."""
    import asyncio
    import logging

    root, sink = tmp_path / "root", (tmp_path / "sink").as_uri()
    dirs = {s: root / layout.step_dir_name(s) for s in (1, 2, 3)}
    for path in dirs.values():
        (path / "model").mkdir(parents=True)
    with _retaining_daemon(root, sink, dirs) as d:
        dirs[1].rename(root / "step-1-kept-by-hand")
        shutil.rmtree(dirs[2])
        with caplog.at_level(logging.INFO, logger="stagerd"):
            asyncio.run(d._retain())
        retired = {r.step: r for r in d._journal.steps(include_retired=True)}
    lines = [r.getMessage() for r in caplog.records if "retired" in r.getMessage()]
    gone = "retired (its directory was already gone: nothing deleted (keep_last=1))"
    assert lines == [f"step 1: {gone}", f"step 2: {gone}"], lines
    assert (root / "step-1-kept-by-hand" / "model").is_dir()
    assert retired[1].state == retired[2].state == "retired" and retired[3].state == "published"


def test_a_retention_cancelled_while_its_thread_deletes_a_step_still_retires_it(tmp_path, caplog, dcp_mixed2):
    """`--once` ends by cancelling housekeeping, then retains once more. A cancel that came while retention's
    thread took step 1 away left step 1 published in the journal; the last pass found its directory gone and
    logged and journaled "already gone: nothing deleted", though retention had deleted it."""
    import asyncio
    import logging
    import threading

    from tests.daemon_helpers import stage_copy

    root, sink = tmp_path / "root", (tmp_path / "sink").as_uri()
    dirs = {s: stage_copy(root, s, dcp_mixed2[0], world=2) for s in (1, 2, 3)}
    with _retaining_daemon(root, sink, dirs) as d:
        remove, begun, go_on = d._remove_published, threading.Event(), threading.Event()

        def held_at_its_start(*args):  # the thread is in the step's delete when the task is cancelled
            begun.set()
            go_on.wait(30)
            return remove(*args)

        async def cancelled_then_retained_again() -> None:
            first = asyncio.create_task(d._retain())
            assert await asyncio.get_running_loop().run_in_executor(None, begun.wait, 30)
            first.cancel()
            go_on.set()
            with contextlib.suppress(asyncio.CancelledError):
                await first
            d._remove_published = remove  # type: ignore[method-assign]
            await d._retain()

        d._remove_published = held_at_its_start  # type: ignore[method-assign]
        with caplog.at_level(logging.INFO, logger="stagerd"):
            asyncio.run(cancelled_then_retained_again())
        retired = {r.step: r for r in d._journal.steps(include_retired=True)}
    lines = [r.getMessage() for r in caplog.records if "retired" in r.getMessage()]
    deleted = "retired (staged data deleted (keep_last=1))"
    assert lines == [f"step 1: {deleted}", f"step 2: {deleted}"], lines
    assert not dirs[1].exists() and not dirs[2].exists() and dirs[3].is_dir()
    assert retired[1].state == retired[2].state == "retired" and retired[3].state == "published"


def test_clear_stale_removes_a_dead_holders_step_lock_and_never_a_held_one(tmp_path):
    """A daemon killed while retention holds a step's lock leaves `ROOT/.step-N.lock`; once the step is
    retired nobody takes that lock again, so the restart removes it, but only where nobody holds it."""
    import subprocess
    import sys

    from stagerd.contract.step.lock import StepLock, clear_stale, lock_path
    from tests.cli_helpers import REPO, clean_env

    killed = (
        "import os, signal, sys\n"
        "from stagerd.contract.step.lock import StepLock\n"
        "StepLock(sys.argv[1], 7, 'retention').acquire()\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    r = subprocess.run([sys.executable, "-c", killed, str(tmp_path)], env=clean_env(), cwd=REPO, timeout=60)
    assert r.returncode == -9 and lock_path(tmp_path, 7).exists()
    with StepLock(tmp_path, 8, "a Stager save"):
        assert not clear_stale(tmp_path, 8) and lock_path(tmp_path, 8).exists()
    assert clear_stale(tmp_path, 7) and not lock_path(tmp_path, 7).exists()
    assert not clear_stale(tmp_path, 9)  # none there
