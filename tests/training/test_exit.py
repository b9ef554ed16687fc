"""Exit hygiene: after close(), or at exit without it, nothing the Stager started runs or holds on (issue 17).

The abort at exit ("terminate called without an active exception", SIGABRT) came from a refused or failed
save whose exception kept the save's frames, and through them the caller's state dict, its DeviceMesh and
process groups, alive in a reference cycle until the interpreter's last collection. The checks here run
with the cyclic collector off, so anything kept only by a cycle shows up as still alive.
"""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from stagerd.errors import SaveError, StepExistsError
from tests.gloo import join, launch
from tests.training.gloo_run import WORLD, attempt, dtensors, record

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def no_cyclic_gc() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _refused(stager, sd: dict[str, torch.Tensor], step: int) -> bool:
    # Not pytest.raises: its ExceptionInfo would keep the traceback, and the frames with it, alive.
    try:
        stager.save(sd, step)
    except StepExistsError:
        return True
    return False


def test_a_refused_save_keeps_nothing_of_the_callers_state_alive(tmp_path, no_cyclic_gc):
    from stagerd import Stager

    sd = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4)}
    stager = Stager(tmp_path)
    stager.save(sd, 1).result()
    assert _refused(stager, sd, 1)
    tensor = weakref.ref(sd["w"])
    del sd
    assert tensor() is None, "the refused save's exception kept the caller's state dict alive"
    stager.close()


def test_a_failed_save_does_not_keep_the_stager_alive_after_close(tmp_path, no_cyclic_gc):
    from stagerd import Stager

    (tmp_path / "step-00000002").write_text("not a directory")  # DCP's write of model/ fails
    stager = Stager(tmp_path)
    handle = stager.save({"w": torch.ones(4)}, 2)
    assert isinstance(handle.exception(timeout=60), SaveError)
    del handle
    try:
        stager.close()  # reports the failed save once more
    except SaveError:
        pass
    alive = weakref.ref(stager)
    del stager
    assert alive() is None, "a failed save's exception kept the Stager (and its process group) alive"


def test_close_leaves_no_thread_of_its_own(tmp_path):
    from stagerd import Stager

    before = set(threading.enumerate())
    with Stager(tmp_path) as stager:
        stager.save({"w": torch.ones(8)}, 1)
        stager.save({"w": torch.zeros(8)}, 2)
        assert _refused(stager, {"w": torch.ones(8)}, 1)
    left = [t.name for t in set(threading.enumerate()) - before if t.is_alive()]
    assert left == [], f"threads still running after close(): {left}"


def _failure_paths_run(rank: int, world: int, init_file: str, root: str, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    from stagerd import Stager

    join(rank, world, init_file)
    try:
        sd = dtensors(world, rank)
        threads = set(threading.enumerate())
        groups = len(distributed_c10d._world.pg_map)
        rec = {}
        for path in ("refused", "failed-save", "timeout"):
            base = Path(root) / path
            stager = Stager(base, timeout=2)
            stager.save(sd, 1).result()
            if path == "refused":
                try:
                    stager.save(sd, 1)
                    failed = {"save": None}
                except StepExistsError as e:
                    failed = {"save": str(e)}
            elif path == "failed-save":
                if rank == 0:  # a file where the step's directory goes: DCP's write fails on every rank
                    (base / "step-00000002").write_text("")
                failed = attempt(stager, sd, 2)
            elif rank == 0:
                failed = attempt(stager, sd, 2)  # rank 1 never joins: the group's timeout runs out
            else:
                time.sleep(3)
                failed = {}
            stager.close()
            rec[path] = {
                "failed": failed,
                "groups": len(distributed_c10d._world.pg_map) - groups,
                "threads": [t.name for t in set(threading.enumerate()) - threads if t.is_alive()],
            }
        record(Path(out), rank, rec)
    finally:
        dist.destroy_process_group()


def test_close_after_each_failure_path_leaves_no_group_or_thread(tmp_path):
    """2 ranks: after a refused step, a failed write and a timed-out check-in, close() leaves nothing."""
    out = tmp_path / "out"
    out.mkdir()
    # The ranks exit through the interpreter's teardown, where the abort this module is about happened:
    # ended by os._exit (launch's default), one that close() left possible would go unseen.
    launch(_failure_paths_run, str(tmp_path / "root"), str(out), deadline_s=120, teardown=True)
    recs = [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]
    for rank, rec in enumerate(recs):
        assert "already committed" in (rec["refused"]["failed"]["save"] or ""), rec["refused"]
        failed_save = rec["failed-save"]["failed"]["handle"] or ""
        assert "step 2 was not committed" in failed_save, rec["failed-save"]
        for path, seen in rec.items():
            assert seen["groups"] == 0, f"rank {rank}, {path}: the Stager's process group outlived close()"
            assert seen["threads"] == [], f"rank {rank}, {path}: threads outlived close(): {seen['threads']}"
    assert "lost contact with the other ranks" in (recs[0]["timeout"]["failed"]["save"] or ""), recs[0]


# Registered before stagerd is imported, so it runs after stagerd's own exit hook (atexit is LIFO).
FORGETFUL_TRAINER = """
import atexit, sys, threading, torch, torch.distributed as dist
from torch.distributed import distributed_c10d

def left_behind():
    groups = len(distributed_c10d._world.pg_map) - 1  # the default group is the trainer's own
    threads = sorted(t.name for t in threading.enumerate() if t.name.startswith("stagerd"))
    print(f"groups={groups} threads={threads}", flush=True)

atexit.register(left_behind)
dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=0, world_size=1)
from stagerd import Stager
from stagerd.errors import StepExistsError
stager = Stager(sys.argv[1])
stager.save({"w": torch.ones(4)}, 1).result()
try:
    stager.save({"w": torch.ones(4)}, 1)
except StepExistsError:
    pass
stager.save({"w": torch.ones(4)}, 2)  # still being written when the script ends, and never closed
"""


def test_a_process_that_forgets_close_exits_cleanly_with_nothing_left(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-c", FORGETFUL_TRAINER, str(tmp_path / "root"), str(tmp_path / "init")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "groups=0 threads=[]", proc.stdout
    assert (tmp_path / "root" / "step-00000002" / "stagerd.commit.json").is_file()  # the exit hook waited


@pytest.mark.slow
@pytest.mark.parametrize("scenario", ["refused", "no-close", "failed-save"])
def test_two_rank_jobs_exit_cleanly_after_every_failure_path(scenario):
    """The 2-rank repro of the exit-time SIGABRT, once each, without the CPU load that made it frequent
    (`bench/stress_exit.py --runs 200` is the stress run)."""
    proc = subprocess.run(
        [sys.executable, "bench/stress_exit.py", "--runs", "1", "--scenario", scenario, "--no-load"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "1 runs in" in proc.stdout and "0 not clean" in proc.stdout
