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
        if limit is None:
            return f.read()
        want = min(os.fstat(f.fileno()).st_size + 1, limit)
        data = f.read(want)
        return data if len(data) < want else data + f.read(limit - want)  # it grew since: on to the limit


def linked(path: Path, why: str, hint: str) -> SymlinkError:
    try:
        target = f" (-> {os.readlink(path)})"
    except OSError:
        target = ""
    return SymlinkError(f"is a symbolic link{target}; {why}", path=path, hint=hint)
