"""Retention: which published steps go, the low-disk thresholds, and the trash that makes deleting a step
atomic (a step is renamed into ROOT/.stagerd/trash, then removed; a crash in between leaves only trash)."""

from __future__ import annotations

import os

from stagerd.contract import layout
from stagerd.daemon.retention import (
    StepView,
    disk_state,
    empty_trash,
    move_to_trash,
    plan_retention,
    trash_dir,
)


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
    assert empty_trash(tmp_path) == 3
    assert list(trash_dir(tmp_path).iterdir()) == []
