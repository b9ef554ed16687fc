"""As many open files as the system lets this process have, and how many of them its inputs may take.

An export holds each input file open while it runs, so that a link swapped in later leads no read
elsewhere: a checkpoint of some hundreds of ranks needs more descriptors than the soft limit many systems
start a process with (1024), though the hard limit allows far more. Python never raises it by itself.
A step of more files than even the hard limit allows is read through a bounded number of them
(`descriptor_budget`): the rest are opened again when read (`contract/step/held.py`).
"""

from __future__ import annotations

import logging
import resource

RESERVE = 256  # left to the rest of the daemon: journal, logs, sockets, outputs, threads

log = logging.getLogger("stagerd")


def raise_open_files_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard one (bounded by the kernel's `nr_open`); the soft limit
    now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard
    if want == resource.RLIM_INFINITY:  # Linux refuses more than nr_open
        try:
            with open("/proc/sys/fs/nr_open") as f:
                want = int(f.read())
        except (OSError, ValueError):
            return soft
    if soft != resource.RLIM_INFINITY and soft >= want:
        return soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    except (OSError, ValueError) as e:
        log.debug("open-files limit stays %d: %s", soft, e)
        return soft
    return want


def descriptor_budget() -> int:
    """The descriptors a process's inputs may hold at once: the soft limit now in force less a margin for
    the rest of the daemon (half of a small limit)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        soft = 1 << 20
    return max(4, soft - min(RESERVE, soft // 2))
