"""As many open files as the system lets this process have.

An export holds each input file open while it runs, so that a link swapped in later leads no read
elsewhere: a checkpoint of some hundreds of ranks needs more descriptors than the soft limit many systems
start a process with (1024), though the hard limit allows far more. Python never raises it by itself.
"""

from __future__ import annotations

import logging
import resource

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
