"""A trainer's hold on one staged step that the daemon's retention must not delete: the Hugging Face
Trainer's best checkpoint, which `load_best_model_at_end` reads back at the end of training, and the step
a Lightning `ModelCheckpoint`'s `best_model_path` names, which `ckpt_path="best"` reads after `fit`.

Each process that needs the step holds a shared `flock` on `ROOT/.step-N.pin` (beside the step lock: the
trainer and the daemon may run as different users, and a dot name is no step). Retention takes an
exclusive lock without waiting: it cannot while any holder lives, so the step is kept; it holds that lock
through the step's removal, so no new hold begins meanwhile. A holder that dies releases its hold with its
file descriptor, so a pin never outlives its trainer. Where the lock cannot be had for another reason (a
filesystem without `flock`, a ROOT this user cannot create files in), the hold is skipped with a warning:
a pin never becomes a new way for training to fail.
"""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path

from stagerd.contract import layout
from stagerd.contract.step.lock import still_at

log = logging.getLogger("stagerd")


def pin_path(root: str | os.PathLike[str], step: int) -> Path:
    return Path(root) / f".{layout.step_dir_name(step)}.pin"


class StepPin:
    """`pin = StepPin(root, step).hold()` ... `pin.release()`: while held, retention keeps the step."""

    def __init__(self, root: str | os.PathLike[str], step: int) -> None:
        self.path, self.step = pin_path(root, step), step
        self._fd: int | None = None

    def hold(self) -> StepPin:
        import fcntl

        if self._fd is not None:
            return self
        while True:
            try:
                fd = _open(self.path, os.O_CREAT)
            except OSError as e:
                return self._skipped(e)
            try:
                fcntl.flock(fd, fcntl.LOCK_SH)  # waits only while retention checks or removes this step
            except OSError as e:
                os.close(fd)
                return self._skipped(e)
            if still_at(fd, self.path):
                self._fd = fd
                return self
            os.close(fd)  # unlinked by retention between our open and our lock: pin the new file

    def _skipped(self, e: OSError) -> StepPin:
        log.warning("no pin on %s (%s): retention may delete step %d", self.path, e.strerror, self.step)
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class Unpinned:
    """Retention's side: `with Unpinned(root, step) as free:` ... `free` is False while a trainer holds the
    step; while True, no hold can begin until the block ends."""

    def __init__(self, root: str | os.PathLike[str], step: int, *, tidy: bool = True) -> None:
        self.path, self.tidy = pin_path(root, step), tidy
        self._fd: int | None = None

    def __enter__(self) -> bool:
        import fcntl

        try:
            fd = _open(self.path)
        except FileNotFoundError:
            return True  # never pinned
        except OSError as e:
            return e.errno != errno.ELOOP  # a link planted as a pin: keep the step rather than follow it
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            return e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN)
        self._fd = fd
        return True

    def __exit__(self, *exc: object) -> None:
        if self._fd is not None:
            if self.tidy:
                try:
                    os.unlink(self.path)  # no holder is left, and none can begin while we hold it
                except OSError:
                    pass
            os.close(self._fd)
            self._fd = None


def _open(path: Path, create: int = 0) -> int:
    """The pin file, read-write where this user may (NFS's emulated `flock` wants a writable descriptor
    for an exclusive lock), else read-only: the trainer's file may be another user's, and a local `flock`
    needs no write access."""
    flags = os.O_CLOEXEC | os.O_NOFOLLOW | create
    try:
        return os.open(path, os.O_RDWR | flags, 0o664)
    except PermissionError:
        return os.open(path, os.O_RDONLY | flags, 0o664)


def pinned(root: str | os.PathLike[str], step: int) -> bool:
    """Whether a trainer holds `step` now (retention's plan, `status`; `Unpinned` decides under the step's
    lock). Changes nothing."""
    with Unpinned(root, step, tidy=False) as free:
        return not free
