"""Exit hygiene: after close(), or at exit without it, nothing the Stager started runs or holds on (issue 17).

The abort at exit ("terminate called without an active exception", SIGABRT) came from a refused or failed
save whose exception kept the save's frames, and through them the caller's state dict, its DeviceMesh and
process groups, alive in a reference cycle until the interpreter's last collection. The checks here run
with the cyclic collector off, so anything kept only by a cycle shows up as still alive.
"""

from __future__ import annotations

import gc
import subprocess
import sys
import threading
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from stagerd.errors import SaveError, StepExistsError

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


@pytest.mark.slow
@pytest.mark.parametrize("scenario", ["refused", "no-close", "failed-save"])
def test_two_rank_jobs_exit_cleanly_after_every_failure_path(scenario):
    """The 2-rank repro from issue 17, a few times each, without the CPU load that made it frequent."""
    proc = subprocess.run(
        [sys.executable, "bench/stress_exit.py", "--runs", "3", "--scenario", scenario, "--no-load"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "3 runs in" in proc.stdout and "0 not clean" in proc.stdout
