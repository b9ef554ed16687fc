"""Counting a process's open descriptors for leak checks. A test worker's other descriptors (a finished
test's server or journal, closed when the collector runs) come and go beside the ones under test, so a
leak check counts only the descriptors on files in its own tree."""

from __future__ import annotations

import os
from pathlib import Path


def open_fds(under: Path | None = None) -> int:
    """Descriptors open in this process; with `under`, only those on that tree's files and directories."""
    if under is None:
        return len(os.listdir("/proc/self/fd"))
    root, n = str(under), 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed since it was listed
            continue
        n += target == root or target.startswith(root + "/")
    return n
