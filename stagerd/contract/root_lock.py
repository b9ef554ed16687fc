"""ROOT's lock file, and whether someone holds it: what tells a trainer that a daemon watches its ROOT.

`stagerd watch` (and `stagerd restore`) hold an advisory `flock` on `ROOT/.stagerd/lock` while they run
(`daemon/lock.py` takes it). Asking whether it is held takes a shared flock for an instant, which a held
lock refuses; a daemon starting at that instant tries again for `PROBE_GRACE_S`."""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path

from stagerd.contract import layout

LOCK_NAME = "lock"
PROBE_GRACE_S = 0.5


def lock_path(root: str | os.PathLike[str]) -> Path:
    return Path(root) / layout.STATE_DIR / LOCK_NAME


def try_flock(fd: int, kind: int) -> bool:
    """Take a flock of `kind` without waiting; False while another holds it. Tried again for a moment:
    another process's `held` may hold a shared one for an instant."""
    deadline = time.monotonic() + PROBE_GRACE_S
    while True:
        try:
            fcntl.flock(fd, kind | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if kind == fcntl.LOCK_SH or time.monotonic() > deadline:
                return False
            time.sleep(0.01)


def held(path: str | os.PathLike[str]) -> bool | None:
    """Whether a process holds the flock on `path`, whichever pid namespace it is in (None where the file
    cannot be opened): a shared flock taken and let go at once, which a held lock refuses."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except FileNotFoundError:
        return False
    except OSError:
        return None
    try:
        return not try_flock(fd, fcntl.LOCK_SH)
    except OSError:
        return None
    finally:
        os.close(fd)  # lets the shared flock go
