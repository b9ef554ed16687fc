"""`stagerd watch` beside the loop: starting it, seeing when it exports, waiting for its backlog."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path


def start_daemon(root: Path, sink: Path, log: Path) -> subprocess.Popen:
    """`stagerd watch ROOT --sink file://SINK --keep-last 1`, as a node would run it beside training."""
    here = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([here, os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "stagerd.cli", "watch", str(root), "--sink", sink.as_uri()]
    cmd += ["--keep-last", "1", "--remote-keep-last", "1", "--metrics-port", "0", "--grace-seconds", "5"]
    return subprocess.Popen(
        cmd, env=env, stdout=subprocess.DEVNULL, stderr=open(log, "wb"), preexec_fn=_die_with_parent
    )


def _die_with_parent() -> None:
    """The daemon gets SIGTERM when the bench dies, however it dies (prctl PR_SET_PDEATHSIG)."""
    import ctypes
    import signal

    ctypes.CDLL("libc.so.6").prctl(1, signal.SIGTERM)


class ExportWatch(threading.Thread):
    """Polls ROOT for a step being exported (`export.tmp/`): the intervals the daemon was exporting."""

    def __init__(self, root: Path) -> None:
        super().__init__(daemon=True)
        self.root, self.stop, self._since = root, threading.Event(), None
        self.intervals: list[tuple[float, float]] = []

    def run(self) -> None:
        while not self.stop.is_set():
            busy = any(self.root.glob("step-*/export.tmp"))
            now = time.perf_counter()
            if busy and self._since is None:
                self._since = now
            elif not busy and self._since is not None:
                self.intervals.append((self._since, now))
                self._since = None
            time.sleep(0.05)


def settle_daemon(root: Path, sink: Path, step: int, timeout: float = 120.0) -> float:
    """Wait until the daemon has published `step` and exports nothing: its backlog is not left to slow the
    next method's run, which it has nothing to do with. Seconds waited."""
    from stagerd.contract.layout import step_dir_name

    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        if (sink / step_dir_name(step)).is_dir() and not any(root.glob("step-*/export.tmp")):
            break
        time.sleep(0.1)
    return time.perf_counter() - t0
