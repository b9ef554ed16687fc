"""One writer of a staged step directory at a time: a Stager's save and `stagerd restore` of one step.

Both write `ROOT/step-N`: the save its files (its leader first removes what a crashed save left there),
the restore its landing (which first removes an uncommitted directory there). Each holds an exclusive
`flock` on `ROOT/.step-N.lock`, taken without waiting, from before its first change to its marker; the
other gets `StepBusyError` and changes nothing. The file sits in ROOT itself, which both may write (the
trainer and a daemon's user may differ, and `ROOT/.stagerd` is the daemon's); a dot name is no step.
A holder that dies releases it with its file descriptor. The file is unlinked while still held, and a
taker checks after locking that the path is still the file it locked, so an unlinked lock file is never
mistaken for a held one.

Where the lock cannot be had for another reason than a holder (a filesystem without `flock`, a ROOT this
user cannot create files in), it is skipped with a warning and the save or restore goes on as before: the
lock never becomes a new way for a save to fail.
"""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path

from stagerd.contract import layout
from stagerd.errors import StepBusyError

log = logging.getLogger("stagerd")


def lock_path(root: str | os.PathLike[str], step: int) -> Path:
    return Path(root) / f".{layout.step_dir_name(step)}.lock"


class StepLock:
    """`with StepLock(root, step, "a restore"):` ...; `StepBusyError` while another holds it."""

    def __init__(self, root: str | os.PathLike[str], step: int, who: str) -> None:
        self.path, self.step, self.who = lock_path(root, step), step, who
        self._fd: int | None = None

    def acquire(self) -> StepLock:
        import fcntl

        while True:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o664)
            except OSError as e:
                log.warning("no lock on %s (%s): %s goes on without it", self.path, e.strerror, self.who)
                return self
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                holder = os.pread(fd, 200, 0).decode(errors="replace").strip()
                os.close(fd)
                if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                    raise StepBusyError(
                        f"step {self.step} is being written by {holder or 'another process'}; "
                        f"{self.who} of it waits for that to end",
                        path=self.path.parent / layout.step_dir_name(self.step),
                    ) from None
                log.warning("no lock on %s (%s): %s goes on without it", self.path, e.strerror, self.who)
                return self
            if still_at(fd, self.path):
                break
            os.close(fd)  # unlinked by its last holder between our open and our lock: take the new one
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{self.who} (pid {os.getpid()})".encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> StepLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def clear_stale(root: str | os.PathLike[str], step: int) -> bool:
    """Unlink step's lock file where nobody holds it: a holder killed (SIGKILL, OOM) leaves it, and once the
    step is retired nobody takes it again. Removed under its own lock, as a holder removes it, so a taker
    that opened it meanwhile finds it gone and takes a new one. Whether a file was removed."""
    import fcntl

    path = lock_path(root, step)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if not still_at(fd, path):
            return False
        os.unlink(path)
        return True
    except OSError:
        return False  # held (a save or a restore of the step), or gone
    finally:
        os.close(fd)


def still_at(fd: int, path: Path) -> bool:
    """Whether the file locked through `fd` is still the one at `path`: a holder unlinks its lock file
    while it holds it, so a file opened just before that is no longer anyone's lock."""
    try:
        return os.fstat(fd).st_ino == os.stat(path, follow_symlinks=False).st_ino
    except FileNotFoundError:
        return False
