"""With `--adopt`, the daemon yields the disk to the trainer's own checkpoint being written.

The saves here are HF Trainer `checkpoint-N/` directories (`save_pretrained` of a tiny Llama, built in
memory, then `trainer_state.json` last, as `Trainer._save_checkpoint` writes them), judged by the daemon's
own preset rule. The daemon runs as a real `stagerd watch --adopt hf-trainer` process while a thread of
this test keeps writing the next checkpoint.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.daemon_helpers import (
    Appender,
    WatchProc,
    aged,
    fast_flags,
    free_port,
    is_state,
    start_watch,
    stop_cleanly,
    yield_seconds,
    yields,
)

OLD = time.time() - 3600
MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors")


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A finished HF Trainer checkpoint (DDP layout: whole safetensors, `trainer_state.json`)."""
    import transformers as tf

    from tests.fidelity import models

    d = tmp_path_factory.mktemp("trained") / "checkpoint-1"
    tf.LlamaForCausalLM(models.config("llama")).save_pretrained(d)
    (d / "trainer_state.json").write_text(json.dumps({"global_step": 1, "log_history": []}))
    return d


def _checkpoint(root: Path, step: int, saved: Path, *, finished: bool = True) -> Path:
    d = root / f"checkpoint-{step}"
    d.mkdir(parents=True)
    for name in MODEL_FILES:
        shutil.copy(saved / name, d / name)
    if finished:
        (d / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    return d


def _writing(root: Path, skip: int = -1, preset: str = "hf-trainer") -> int | None:
    """What a fresh daemon over ROOT (`watch --adopt PRESET`) finds being written, `skip` aside."""
    from stagerd.config import Settings
    from stagerd.daemon.core import Daemon

    settings = Settings(root=root, sinks=[(root.parent / "sink").as_uri()], adopt=preset, metrics_port=0)
    return Daemon(settings)._saves.writing(skip=skip)


# -- detection ----------------------------------------------------------------------------------------------


def test_a_checkpoint_not_finished_by_its_preset_and_written_just_now_is_a_save(tmp_path, saved):
    root = tmp_path / "run"
    _checkpoint(root, 1, saved)  # finished (trainer_state.json) just now: its save is over
    assert _writing(root) is None
    mid = _checkpoint(root, 2, saved, finished=False)  # the model written, the rest not yet
    assert _writing(root) == 2
    aged(mid, OLD)  # a save that died an hour ago
    assert _writing(root) is None
    (mid / "trainer_state.json").write_text("{")  # written in place, not parsed yet: not finished
    assert _writing(root) == 2
    (root / "checkpoint-3.tmp").mkdir()
    (root / "checkpoint-3.tmp" / "x").write_bytes(b"x")  # a name that gives no step
    (root / ".stagerd" / "adopted" / "checkpoint-9").mkdir(parents=True)  # the exports built
    (root / ".stagerd" / "adopted" / "checkpoint-9" / "model.safetensors").write_bytes(b"x")
    aged(mid, OLD)
    assert _writing(root) is None


def test_files_in_nested_directories_count_and_links_are_not_followed(tmp_path, saved):
    root = tmp_path / "run"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "fresh").write_bytes(b"x")  # written now, but reached only through a link
    mid = _checkpoint(root, 4, saved, finished=False)
    (mid / "global_step4").symlink_to(elsewhere, target_is_directory=True)
    (mid / "optimizer.pt").symlink_to(elsewhere / "fresh")
    (mid / "pytorch_model_fsdp_0" / "sub").mkdir(parents=True)
    aged(mid, OLD)
    assert _writing(root) is None
    (mid / "pytorch_model_fsdp_0" / "sub" / "__0_0.distcp").write_bytes(b"x" * 64)
    os.utime(mid / "pytorch_model_fsdp_0" / "sub", (OLD, OLD))
    os.utime(mid / "pytorch_model_fsdp_0", (OLD, OLD))
    assert _writing(root) == 4  # two directories down, their own mtimes an hour old
    shutil.rmtree(mid)
    assert _writing(root) is None


def _daemon_saves(root: Path):
    """The saves in flight of one daemon over ROOT (`watch --adopt hf-trainer`), asked again and again."""
    from stagerd.config import Settings
    from stagerd.daemon.core import Daemon

    sink = (root.parent / "sink").as_uri()
    return Daemon(Settings(root=root, sinks=[sink], adopt="hf-trainer", metrics_port=0))._saves


def test_a_file_written_in_place_among_thousands_is_seen_within_a_few_scans(tmp_path, saved):
    from stagerd.daemon.yielding import CACHE_SECONDS, STATS_PER_SCAN

    root = tmp_path / "run"
    mid = _checkpoint(root, 5, saved, finished=False)
    (mid / "optimizer_0").mkdir()
    for i in range(5000):  # every rank's shards, beside the model's files
        (mid / "optimizer_0" / f"__{i}_0.distcp").write_bytes(b"")
    aged(mid, OLD)
    saves = _daemon_saves(root)
    assert saves.writing(skip=-1) is None
    fresh = mid / "optimizer_0" / "__4321_0.distcp"
    scans = 0
    while saves.writing(skip=-1) is None:  # written in place: its directory's mtime stays an hour old
        assert scans <= 5000 // STATS_PER_SCAN + 2, scans
        with open(fresh, "ab") as f:
            f.write(b"x")
        time.sleep(CACHE_SECONDS)
        scans += 1
    # One scan stats a bounded batch: with every file written just now, it knows of that many alone.
    from stagerd.daemon.tree_scan import Tree

    os.utime(mid / "optimizer_0", (OLD, OLD))
    for p in (mid / "optimizer_0").iterdir():
        os.utime(p)
    tree, fd = Tree((0, 0)), os.open(mid, os.O_RDONLY | os.O_DIRECTORY)
    try:
        now = time.time()
        assert tree.scan(fd, now - 3, now + 3, STATS_PER_SCAN) is not None
        assert 0 < len([p for p in tree.hot if p.startswith("optimizer_0/")]) <= STATS_PER_SCAN
    finally:
        os.close(fd)


def test_an_older_checkpoint_being_written_is_seen_beyond_the_newest_few(tmp_path, saved):
    """A run restarted from an earlier checkpoint saves below the abandoned run's leftovers."""
    from stagerd.daemon.yielding import MAX_CHECKPOINTS

    root = tmp_path / "run"
    for k in range(MAX_CHECKPOINTS + 2):
        aged(_checkpoint(root, 100 + 10 * k, saved), OLD)
    saves = _daemon_saves(root)
    assert saves.writing(skip=-1) is None
    _checkpoint(root, 105, saved, finished=False)
    time.sleep(0.1)
    assert saves.writing(skip=-1) == 105


def test_a_save_going_on_after_its_preset_finished_it_holds_its_own_export_too(tmp_path, saved):
    """Accelerate's `save_state` without FSDP: finished by the model's file, its optimizer written after."""
    root = tmp_path / "run"
    d = root / "checkpoint-6"
    d.mkdir(parents=True)
    shutil.copy(saved / "model.safetensors", d / "model.safetensors")
    (d / "random_states_0.pkl").write_bytes(b"x")
    aged(d, OLD)
    assert _writing(root, skip=6, preset="accelerate") is None
    (d / "optimizer.bin").write_bytes(b"x" * 64)  # written now, an hour after the model
    assert _writing(root, skip=6, preset="accelerate") == 6
    from stagerd.config import Settings
    from stagerd.daemon.core import Daemon

    daemon = Daemon(Settings(root=root, sinks=[(tmp_path / "sink").as_uri()], adopt="accelerate"))
    assert daemon._finished_at(d) == OLD  # finished, by the daemon's own rule, an hour ago


# -- the daemon ---------------------------------------------------------------------------------------------


@pytest.fixture
def training(tmp_path, saved) -> Iterator[tuple[Path, Path, Appender]]:
    """The Trainer's output dir: checkpoint-100 finished, checkpoint-101 being written."""
    root = tmp_path / "run"
    _checkpoint(root, 100, saved)
    writer = Appender(_checkpoint(root, 101, saved, finished=False) / "optimizer.pt")
    yield root, tmp_path / "sink", writer
    writer.stop()


async def _watch(root: Path, sink: Path, tmp_path: Path, *flags: str, port: int = 0) -> WatchProc:
    return await start_watch(
        root,
        "--adopt",
        "hf-trainer",
        "--sink",
        sink.as_uri(),
        *fast_flags(metrics_port=port),
        *flags,
        log_dir=tmp_path / "logs",
    )


async def test_the_export_of_a_checkpoint_waits_until_the_next_one_is_finished(training, tmp_path):
    root, sink, writer = training
    port = free_port()
    w = await _watch(root, sink, tmp_path, "--yield-seconds", "30", port=port)
    try:
        rec = await w.wait_for(yields(100, "export"), timeout=30)
        assert rec["yields_to"] == 101
        await asyncio.sleep(1.5)
        assert not any(is_state(100, "exported")(r) for r in w.records())
        writer.stop()
        (root / "checkpoint-101" / "trainer_state.json").write_text(json.dumps({"global_step": 101}))
        finished = time.time()
        done = await w.wait_for(is_state(100, "exported"), timeout=30)
        # trainer_state.json ends the wait at once, not the mtimes going stale (3 s).
        assert done["ts"] - finished < 2.5, done["ts"] - finished
        assert done["yielded_seconds"] >= 1.5
        assert yield_seconds(port, "export") >= 1.5
        await w.wait_for(is_state(101, "published", sink.as_uri()), timeout=60)
    finally:
        await stop_cleanly(w)


async def test_a_checkpoint_never_finished_holds_the_export_only_for_the_budget(training, tmp_path):
    root, sink, _ = training
    w = await _watch(root, sink, tmp_path, "--yield-seconds", "1.5")
    try:
        start = await w.wait_for(yields(100, "export"), timeout=30)
        resumed = await w.wait_for(lambda r: r.get("stage") == "export" and "yielded_seconds" in r, 30)
        assert "budget is spent" in resumed["msg"]
        done = await w.wait_for(is_state(100, "exported"), timeout=30)
        assert 1.4 <= done["ts"] - start["ts"] < 6.0
        await w.wait_for(is_state(100, "published", sink.as_uri()), timeout=30)
    finally:
        await stop_cleanly(w)
    # a running daemon says nothing of the checkpoint still being written (only a `--once` summary does)
    assert "checkpoint-101" not in w.text() and "not finished" not in w.text(), w.text()[-3000:]
