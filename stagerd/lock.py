"""One daemon per ROOT: an advisory `flock` on `ROOT/.stagerd/lock`, which holds the owner's pid.

The kernel drops the lock when the process dies, SIGKILL included, so a stale lock file never blocks a
restart; the pid inside is only for the error message and for `stagerd status`.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from stagerd import layout
from stagerd.errors import LockError

LOCK_NAME = "lock"


def lock_path(root: str | os.PathLike[str]) -> Path:
    return Path(root) / layout.STATE_DIR / LOCK_NAME


class RootLock:
    """The exclusive lock of one ROOT, held until `release()` or process exit."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.path = lock_path(root)
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock or raise LockError naming the pid that holds it."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = read_holder(self.path.parent.parent)
            os.close(fd)
            who = f"pid {holder}" if holder else "another process"
            raise LockError(
                f"ROOT is already watched by stagerd ({who})", path=self.path.parent.parent
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.ftruncate(self._fd, 0)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> RootLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def read_holder(root: str | os.PathLike[str]) -> int | None:
    """The pid written by the daemon that holds (or last held) the lock of `root`, if any."""
    try:
        text = lock_path(root).read_text().strip()
    except (FileNotFoundError, PermissionError):
        return None
    return int(text) if text.isdigit() else None


def running_holder(root: str | os.PathLike[str]) -> int | None:
    """The pid of the daemon watching `root` now, or None. Probes without taking the lock."""
    pid = read_holder(root)
    if pid is None:
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        return pid  # alive, another user's
    return pid
