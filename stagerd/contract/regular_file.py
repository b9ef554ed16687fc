"""Opening what someone else wrote, for reading, without waiting on it or being led elsewhere by it.

`open()` of a FIFO blocks until a writer comes, and a daemon's scan that opens one never returns: nothing
else under ROOT is then exported. Opened with O_NONBLOCK, anything but a regular file is an OSError
(EINVAL) its caller already turns into its own named error; a regular file reads as usual.

`linked` is the one SymlinkError for a directory the daemon journaled that became a symbolic link
(`step/held.py` holds such directories and refuses links in them).
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import BinaryIO

from stagerd.errors import SymlinkError


def open_regular(path: str | os.PathLike[str]) -> BinaryIO:
    """`open(path, "rb")`, refusing (OSError EINVAL) a FIFO, device, socket or directory."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "is not a regular file", str(Path(path)))
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_regular(path: str | os.PathLike[str], limit: int | None = None) -> bytes:
    """At most `limit` bytes (None: all) of the regular file `path` (`open_regular`), never allocating more
    than the file holds: `read(limit)` allocates the limit first."""
    with open_regular(path) as f:
        return read_bounded(f, limit)


def read_bounded(f: BinaryIO, limit: int | None = None) -> bytes:
    """At most `limit` bytes (None: all) of the open file `f`, never allocating more than it holds."""
    if limit is None:
        return f.read()
    want = min(os.fstat(f.fileno()).st_size + 1, limit)
    data = f.read(want)
    return data if len(data) < want else data + f.read(limit - want)  # it grew since: on to the limit


def open_regular_at(dir_fd: int, name: str, path: Path, why: str, hint: str) -> int:
    """The regular file `name` in the directory `dir_fd` (`path` names it in errors) opened for reading
    without following a link: a link there is a SymlinkError (`linked`), anything but a regular file an
    OSError (EINVAL; a FIFO is opened without waiting on a writer)."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError as e:
        if e.errno == errno.ELOOP and is_link_at(name, dir_fd):
            raise linked(path, why, hint) from None
        e.filename = str(path)
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, "is not a regular file", str(path))
    os.set_blocking(fd, True)
    return fd


def is_link_at(name: str | os.PathLike[str], dir_fd: int | None) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def linked(path: Path, why: str, hint: str) -> SymlinkError:
    try:
        target = f" (-> {os.readlink(path)})"
    except OSError:
        target = ""
    return SymlinkError(f"is a symbolic link{target}; {why}", path=path, hint=hint)
