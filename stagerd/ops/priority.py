"""Stay out of the training job's way: CPU niceness and the idle I/O scheduling class.

On Linux both are per thread and inherited by threads created later, so `lower_priority()` must run
before the daemon starts any thread (worker pools, the watcher, the metrics server).
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform

log = logging.getLogger("stagerd")

IOPRIO_WHO_PROCESS = 1
IOPRIO_CLASS_SHIFT = 13
IO_CLASSES = {"best-effort": 2, "idle": 3}
# ioprio_get/ioprio_set syscall numbers; the generic table (aarch64, riscv64) shares 30/31.
_SYSCALLS = {"x86_64": (252, 251), "aarch64": (31, 30), "riscv64": (31, 30), "i686": (290, 289)}


def _syscall(number: int, *args: int) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    res = libc.syscall(number, *[ctypes.c_int(a) for a in args])
    if res < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return res


def get_io_class(pid: int = 0) -> int | None:
    """I/O scheduling class of thread `pid` (0: this one): 0 none, 1 rt, 2 best-effort, 3 idle."""
    nums = _SYSCALLS.get(platform.machine())
    if nums is None:
        return None
    return _syscall(nums[0], IOPRIO_WHO_PROCESS, pid) >> IOPRIO_CLASS_SHIFT


def set_io_class(name: str) -> None:
    """Set the I/O scheduling class (`idle` or `best-effort`, at its lowest level) of this thread."""
    nums = _SYSCALLS.get(platform.machine())
    if nums is None:
        raise OSError(f"ioprio_set: unknown syscall number on {platform.machine()}")
    cls = IO_CLASSES[name]
    level = 7 if name == "best-effort" else 0
    _syscall(nums[1], IOPRIO_WHO_PROCESS, 0, (cls << IOPRIO_CLASS_SHIFT) | level)


def lower_priority(nice: int, io_class: str) -> dict[str, object]:
    """Raise niceness to at least `nice` and set `io_class` ("none" leaves it). Failures only warn.

    Returns what was applied, for the start-up log line.
    """
    applied: dict[str, object] = {}
    if nice > 0:
        current = os.getpriority(os.PRIO_PROCESS, 0)
        if current < nice:
            try:
                os.nice(nice - current)
            except OSError as e:
                log.warning("cannot lower CPU priority to nice %d: %s", nice, e)
        applied["nice"] = os.getpriority(os.PRIO_PROCESS, 0)
    if io_class != "none":
        try:
            set_io_class(io_class)
            applied["io_class"] = io_class
        except OSError as e:
            log.warning("cannot set I/O class %s: %s", io_class, e)
    return applied
