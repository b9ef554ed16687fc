"""One daemon per ROOT: an advisory `flock` on `ROOT/.stagerd/lock`, which says who holds it.

The kernel drops the lock when the process dies, SIGKILL included, so a stale lock file never blocks a
restart. What the file says, `PID PIDNS COMMAND` (`watch` or `restore`), is informative only (the error
message, `stagerd status`): the flock is the lock, so a disk too full to take it is a warning, and the
holder is then found in /proc/locks instead.

A pid means something only in its own pid namespace: the containers of a Kubernetes pod share ROOT, not
their pids. So the file's pid is believed only when its PIDNS is this process's, and /proc/locks lists
only the locks of processes this /proc's namespace sees (their pids translated to it). Whether the lock
is held at all is the kernel's word, asked with a shared flock for an instant (`held`): held, and no
holder to name here, is a daemon (or restore) in another container.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from stagerd.contract.root_lock import LOCK_NAME as LOCK_NAME
from stagerd.contract.root_lock import held, lock_path, try_flock
from stagerd.errors import LockError, SymlinkError
from stagerd.ops.processes import PID_NS, pid_alive

COMMANDS = ("watch", "restore")
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)

log = logging.getLogger("stagerd")


class LockFileError(LockError):
    """The lock file under ROOT/.stagerd cannot be created or opened (no space or inodes, permissions)."""

    hint = "check that ROOT/.stagerd is writable by this user and its filesystem has free space and inodes"

    def __init__(self, err: OSError, path: Path) -> None:
        super().__init__(f"cannot open the lock file: {err.strerror or err}", path=path)
        self.retryable = err.errno in _NO_SPACE  # freeing space helps; a permission never comes by itself


def file_replaced(path: Path, held: os.stat_result, kind: str = "file") -> str | None:
    """Why `path` no longer names the file (or directory: `kind`) `held` describes (deleted, or another
    one now), or None."""
    try:
        now = os.stat(path)
    except FileNotFoundError:
        return f"{path} was deleted"
    except OSError as e:
        return f"{path} cannot be checked: {e.strerror or e}"
    if (now.st_dev, now.st_ino) != (held.st_dev, held.st_ino):
        return f"{path} was replaced by another {kind}"
    return None


# LockError's own hint speaks to a second daemon; a restore wants the daemon out of the way for a while.
_RESTORE_HINT = (
    "a restore never writes into a ROOT a daemon watches: stop that `stagerd watch`, run the restore, then "
    "start the daemon again (it leaves the restored step alone); or restore into a new ROOT"
)


class RootLock:
    """The exclusive lock of one ROOT, held until `release()` or process exit."""

    def __init__(self, root: str | os.PathLike[str], command: str = "watch") -> None:
        self.path = lock_path(root)
        self.command = command  # what the file says holds ROOT: `watch` or `restore`
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock or raise LockError naming who holds it."""
        fd = self._open()
        if not try_flock(fd, fcntl.LOCK_EX):
            root = self.path.parent.parent
            holder = root_holder(root)
            os.close(fd)
            who = holder.who if holder else "another process"
            if holder is not None and holder.command == "restore":
                raise LockError(
                    f"ROOT is held by a running `stagerd restore` ({who})",
                    path=root,
                    hint="wait for the restore to end, then run this again",
                ) from None
            raise LockError(
                f"ROOT is already watched by stagerd ({who})",
                path=root,
                hint=_RESTORE_HINT if self.command == "restore" else None,
            ) from None
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
        """Write who we are over the old holder in place (no new block needed), then cut what is left."""
        data = f"{os.getpid()} {PID_NS} {self.command}\n".encode()
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


def _record(root: str | os.PathLike[str]) -> tuple[int | None, str | None]:
    """(the pid, the command) the lock file of `root` says: the pid only where it is of this pid
    namespace. An older stagerd's file (the pid alone) says no namespace: its pid is believed only while
    it is a `stagerd watch` or `restore` here, not some process of this namespace that has that number."""
    try:
        f = lock_path(root).read_text().split()
    except (OSError, UnicodeDecodeError):
        return None, None
    if not f or not f[0].isdigit():
        return None, None
    if len(f) == 1:
        return (int(f[0]), None) if holder_command(int(f[0])) else (None, None)
    pid = int(f[0]) if f[1] == PID_NS else None
    return pid, next((c for c in f[2:3] if c in COMMANDS), None)


def read_holder(root: str | os.PathLike[str]) -> int | None:
    """The pid (in this pid namespace) the lock file of `root` names, if any: its holder's, or the last."""
    return _record(root)[0]


def flock_holder(path: str | os.PathLike[str]) -> int | None:
    """The pid holding a flock on `path` according to the kernel (/proc/locks), or None. The kernel lists
    only the locks of processes this /proc's pid namespace sees, their pids in it: another container's
    daemon is not there (an older kernel lists it with pid 0)."""
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
    """The pid (in this pid namespace) the lock file of `root` names, else the one the kernel says holds
    its flock, or None."""
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


@dataclass(frozen=True)
class Holder:
    """Who holds ROOT's lock now: `pid` None where it is a process of another pid namespace (container)."""

    pid: int | None
    command: str | None  # `watch`, `restore`, or None where unknown

    @property
    def who(self) -> str:
        return f"pid {self.pid}" if self.pid else "a process in another container (pid namespace)"


def root_holder(root: str | os.PathLike[str]) -> Holder | None:
    """Who holds the lock of `root` now, or None. Probes without taking the lock (a shared flock for an
    instant, which keeps no daemon out: `acquire` tries again meanwhile)."""
    path = lock_path(root)
    locked = held(path)
    pid = named_holder(root)
    if locked is None:  # the file cannot be opened here: the pid, if alive, is all there is to go by
        return Holder(pid, holder_command(pid)) if pid is not None and pid_alive(pid) else None
    if not locked:
        return None
    if pid is not None and not pid_alive(pid):
        pid = flock_holder(path)  # the file's pid is gone: the holder is another (its pid unwritten)
    said = _record(root)[1]
    return Holder(pid, (holder_command(pid) if pid else None) or said)


def running_holder(root: str | os.PathLike[str]) -> int | None:
    """The pid (in this pid namespace) of the process holding the lock of `root` now, or None: None too
    where a process of another container holds it (`root_holder` says so)."""
    h = root_holder(root)
    return h.pid if h else None
