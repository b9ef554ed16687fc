"""`stagerd watch` beside the loop: starting it, seeing when it exports and publishes, waiting for its
backlog."""

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


class DaemonWatch(threading.Thread):
    """Polls what the daemon is doing, every 50 ms: exporting a step (`step-*/export.tmp/` in ROOT, paused
    yields included) and publishing one (a temp file in the `file://` sink). Per activity, the intervals
    it was seen; two seen less than `GAP` apart are one, as a publish moves from one file to the next."""

    GAP = 0.15

    def __init__(self, root: Path, sink: Path) -> None:
        super().__init__(daemon=True)
        self.stop = threading.Event()
        self._probes = {
            "export": lambda: any(root.glob("step-*/export.tmp")),
            "publish": lambda: any(sink.glob("step-*/**/.*.tmp-*")),
        }
        self.intervals: dict[str, list[tuple[float, float]]] = {name: [] for name in self._probes}

    def run(self) -> None:
        since: dict[str, float | None] = dict.fromkeys(self._probes)
        while not self.stop.is_set():
            for name, probe in self._probes.items():
                busy, now, seen = probe(), time.perf_counter(), self.intervals[name]
                if busy and since[name] is None:
                    if seen and now - seen[-1][1] < self.GAP:
                        since[name] = seen.pop()[0]
                    else:
                        since[name] = now
                elif not busy and since[name] is not None:
                    seen.append((since[name], now))  # type: ignore[arg-type]
                    since[name] = None
            time.sleep(0.05)
        for name, t in since.items():  # still busy at the end: the interval so far
            if t is not None:
                self.intervals[name].append((t, time.perf_counter()))


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
