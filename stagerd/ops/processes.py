"""Which processes a pid names here: this process's pid namespace, and whether a pid of it is alive.

A pid means something only in its own pid namespace: the containers of one Kubernetes pod share a host
name and volumes, not their pids. So whatever records a pid to be judged later records `PID_NS` beside it,
and a reader judges the pid only where the namespace is its own.
"""

from __future__ import annotations

import os


def _pid_ns() -> str:
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return ""  # no /proc: no pid namespaces to tell apart


PID_NS = _pid_ns()
_PID_MAX = 2**22  # Linux's largest pid_max


def pid_alive(pid: int) -> bool:
    """Whether `pid` is a live process of this pid namespace (ours counts as alive)."""
    if pid == os.getpid():
        return True
    if not 0 < pid <= _PID_MAX:
        return False  # no process has it (os.kill would overflow past a C int)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return not _exited(pid)


def _exited(pid: int) -> bool:
    """Whether `pid` is a zombie: it exited (its files closed, its locks released) and its parent has not
    reaped it yet. One that no parent ever reaps (orphaned under a container's PID 1 that reaps nobody)
    would otherwise hold what it held for good."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False  # no /proc, or gone since: os.kill's answer stands, or the next look tells
    state = stat[stat.rfind(b")") + 2 :][:1]  # the name in parentheses may hold spaces and ')'
    return state in (b"Z", b"X")
