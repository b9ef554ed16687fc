"""Input files of a held step closed for want of descriptors, and opened again only as themselves.

A step may have more files than the process may hold open (8,192 ranks under a hard limit of 4,096): the
input files of all the held steps together keep at most half of `ops/fdlimit.descriptor_budget` open
(`take`). Each file beyond that is opened once through its held directory (without following a link),
its identity noted (device, inode, size, mtime), closed, and named by `/proc/self/fd/D/NAME`, D being the
directory it was opened from, still held. Such a path must never be opened by name, which would follow a
link put at NAME: `open_held` opens it from D again with O_NOFOLLOW and checks that it is the very file
first opened, else a `SourceChangedError` (nothing read from it). The readers of a step's inputs open
every path with `open_held` (`os.open`'s arguments, or `open(path, "rb", opener=open_held)`), which opens
any other path as `os.open` does.
"""

from __future__ import annotations

import errno
import os
import stat
import threading
from dataclasses import dataclass
from pathlib import Path

from stagerd.errors import SourceChangedError
from stagerd.ops.fdlimit import descriptor_budget

FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
CHANGED_HINT = "the step's files were replaced while it was read; nothing was published. stagerd tries again"


@dataclass(frozen=True)
class Closed:
    """A file opened once from the held directory `dir_fd`, now closed: how to open it again."""

    dir_fd: int
    name: str
    real: Path  # the path that names it in messages
    ident: tuple[int, int, int, int]  # st_dev, st_ino, st_size, st_mtime_ns when first opened

    @property
    def path(self) -> Path:
        return Path(f"/proc/self/fd/{self.dir_fd}/{self.name}")


def identity(st: os.stat_result) -> tuple[int, int, int, int]:
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


_lock = threading.Lock()
_closed: dict[str, list[Closed]] = {}  # by `path`; two holders of one directory may close the same name
_held = 0  # input files held open by every `HeldFiles`, which closes the rest


def take() -> bool:
    """Whether one more input file may stay open (then counted until `give`)."""
    global _held
    with _lock:
        if _held >= descriptor_budget() // 2:
            return False
        _held += 1
        return True


def held() -> int:
    """How many input files are held open now."""
    return _held


def give(n: int) -> None:
    global _held
    with _lock:
        _held -= n


def park(dir_fd: int, name: str, real: Path, st: os.stat_result) -> Closed:
    """Note the file `name` of `dir_fd` (whose `st` was just taken from it open) as closed."""
    c = Closed(dir_fd, name, real, identity(st))
    with _lock:
        _closed.setdefault(str(c.path), []).append(c)
    return c


def unpark(c: Closed) -> None:
    with _lock:
        left = _closed.get(str(c.path), [])
        left.remove(c)
        if not left:
            del _closed[str(c.path)]


def closed(path: str | os.PathLike[str]) -> Closed | None:
    """The closed file `path` names, if it names one."""
    with _lock:
        found = _closed.get(os.fspath(path)) if isinstance(path, (str, os.PathLike)) else None
        return found[-1] if found else None


def open_held(
    path: str | os.PathLike[str], flags: int = os.O_RDONLY | os.O_CLOEXEC, mode: int = 0o777
) -> int:
    """`os.open(path, flags, mode)`, but a closed input file (see the module) is opened again through its
    held directory, for reading, and only if it is the file first opened there."""
    c = closed(path)
    return os.open(path, flags, mode) if c is None else reopen(c)


def reopen(c: Closed) -> int:
    """A new descriptor of the file `c`, read-only; a `SourceChangedError` if its name in the held directory
    is now a link, another file, or gone. Other failures (out of descriptors) are the OSError."""
    try:
        fd = os.open(c.name, FILE_FLAGS, dir_fd=c.dir_fd)
    except OSError as e:
        if e.errno in (errno.ENOENT, errno.ELOOP, errno.ENOTDIR, errno.ENXIO):
            raise _changed(c, "is gone or a link now") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or identity(st) != c.ident:
            raise _changed(c, "is another file now, or was rewritten")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _changed(c: Closed, what: str) -> SourceChangedError:
    return SourceChangedError(
        f"{what}: opened again to be read, it is not the file the step was checked with",
        path=c.real,
        hint=CHANGED_HINT,
    )
