"""`lower_priority`: real niceness and I/O class syscalls, in a child so the runner keeps its own."""

from __future__ import annotations

import json
import platform
import subprocess
import sys

import pytest

from tests.cli_helpers import clean_env

CHILD = """
import json, os, sys
from stagerd.ops.priority import get_io_class, lower_priority
nice, io_class = int(sys.argv[1]), sys.argv[2]
before = get_io_class()
applied = lower_priority(nice, io_class)
print(json.dumps({"applied": applied, "nice": os.getpriority(os.PRIO_PROCESS, 0),
                  "io_before": before, "io_after": get_io_class()}))
"""


def _child(nice: int, io_class: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(nice), io_class],
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return json.loads(proc.stdout)


pytestmark = pytest.mark.skipif(
    platform.machine() not in ("x86_64", "aarch64", "riscv64", "i686"), reason="no ioprio syscall numbers"
)


def test_lowers_cpu_and_io_priority() -> None:
    got = _child(12, "idle")
    assert got["nice"] >= 12 and got["applied"] == {"nice": got["nice"], "io_class": "idle"}
    assert got["io_after"] == 3  # IOPRIO_CLASS_IDLE


def test_best_effort_class() -> None:
    assert _child(0, "best-effort")["io_after"] == 2


def test_none_and_zero_leave_everything_as_it_was() -> None:
    got = _child(0, "none")
    assert got["applied"] == {} and got["io_after"] == got["io_before"]


def test_never_raises_niceness_back_down() -> None:
    """A process already nicer than asked stays as nice as it was."""
    proc = subprocess.run(
        ["nice", "-n", "15", sys.executable, "-c", CHILD, "5", "none"],
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert json.loads(proc.stdout)["nice"] >= 15
