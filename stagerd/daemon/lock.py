"""One daemon per ROOT: an advisory `flock` on `ROOT/.stagerd/lock`, which holds the owner's pid.

The kernel drops the lock when the process dies, SIGKILL included, so a stale lock file never blocks a
restart. The pid inside is informative only (the error message, `stagerd status`): the flock is the lock, so
a disk too full to take the pid is a warning, and the holder is then found in /proc/locks instead.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
from pathlib import Path

from stagerd.contract import layout
from stagerd.errors import LockError, SymlinkError

LOCK_NAME = "lock"
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)

log = logging.getLogger("stagerd")


class LockFileError(LockError):
    """The lock file under ROOT/.stagerd cannot be created or opened (no space or inodes, permissions)."""

    hint = "check that ROOT/.stagerd is writable by this user and its filesystem has free space and inodes"

    def __init__(self, err: OSError, path: Path) -> None:
        super().__init__(f"cannot open the lock file: {err.strerror or err}", path=path)
        self.retryable = err.errno in _NO_SPACE  # freeing space helps; a permission never comes by itself


def file_replaced(path: Path, held: os.stat_result) -> str | None:
    """Why `path` no longer names the file `held` describes (deleted, or another file now), or None."""
    try:
        now = os.stat(path)
    except FileNotFoundError:
        return f"{path} was deleted"
    except OSError as e:
        return f"{path} cannot be checked: {e.strerror or e}"
    if (now.st_dev, now.st_ino) != (held.st_dev, held.st_ino):
        return f"{path} was replaced by another file"
    return None


def lock_path(root: str | os.PathLike[str]) -> Path:
    return Path(root) / layout.STATE_DIR / LOCK_NAME


class RootLock:
    """The exclusive lock of one ROOT, held until `release()` or process exit."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.path = lock_path(root)
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock or raise LockError naming the pid that holds it."""
        fd = self._open()
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = named_holder(self.path.parent.parent)
            os.close(fd)
            who = f"pid {holder}" if holder else "another process"
            root = self.path.parent.parent
            if holder is not None and holder_command(holder) == "restore":
                raise LockError(
                    f"ROOT is held by a running `stagerd restore` ({who})",
                    path=root,
                    hint="wait for the restore to end, then run this again",
                ) from None
            raise LockError(f"ROOT is already watched by stagerd ({who})", path=root) from None
        self._fd = fd
        self._write_pid(fd)

    def _open(self) -> int:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # The pid is written over the file's start and the file cut after it: never through a link.
            return os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
        except OSError as e:
            if e.errno == errno.ELOOP and self.path.is_symlink():
                raise SymlinkError(
                    f"is a symbolic link (-> {os.readlink(self.path)}); the daemon writes its pid into its "
                    "lock file and never through a link",
                    path=self.path,
                    hint="remove the link (its target is left as it is); the daemon makes its own lock file",
                ) from None
            raise LockFileError(e, self.path) from None

    def _write_pid(self, fd: int) -> None:
        """Write our pid over the old one in place (no new block needed), then cut what is left after it."""
        data = f"{os.getpid()}\n".encode()
        try:
            os.pwrite(fd, data, 0)
            os.ftruncate(fd, len(data))
        except OSError as e:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)  # never leave another process's pid behind; shrinking needs no space
            log.warning(
                "cannot write this daemon's pid into %s (%s); the lock is held all the same",
                self.path,
                e.strerror or e,
                extra={"lock": str(self.path), "errno": e.errno},
            )

    def lost(self) -> str | None:
        """Why the lock file at our path is no longer the one we hold (deleted or replaced), or None."""
        if self._fd is None:
            return None
        return file_replaced(self.path, os.fstat(self._fd))

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


def flock_holder(path: str | os.PathLike[str]) -> int | None:
    """The pid holding a flock on `path` according to the kernel (/proc/locks), or None."""
    try:
        st = os.stat(path)
        table = Path("/proc/locks").read_text()
    except OSError:
        return None
    where = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    for line in table.splitlines():
        # "3: FLOCK  ADVISORY  WRITE 1234 00:2d:56789 0 EOF"; a waiter's line has "->" after the number.
        f = line.split()
        if len(f) > 5 and f[1] == "FLOCK" and f[5] == where and f[4].isdigit() and int(f[4]) > 0:
            return int(f[4])
    return None


def named_holder(root: str | os.PathLike[str]) -> int | None:
    """The pid the lock file of `root` names, else the one the kernel says holds its flock, or None."""
    return read_holder(root) or flock_holder(lock_path(root))


def holder_command(pid: int) -> str | None:
    """The stagerd command the lock holder runs (`watch`, `restore`), from /proc; None where unknown. The
    lock is taken by both, and a user told "watched" looks for a daemon that is not there."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read(4096).split(b"\0")
    except OSError:
        return None
    # the first one: ROOT itself may be a directory named `restore`
    return next((a.decode() for a in argv if a in (b"restore", b"watch")), None)


def running_holder(root: str | os.PathLike[str]) -> int | None:
    """The pid of the daemon watching `root` now, or None. Probes without taking the lock."""
    pid = named_holder(root)
    if pid is None:
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        return pid  # alive, another user's
    return pid
