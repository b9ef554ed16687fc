"""Opening what someone else wrote, for reading, without waiting on it or being led elsewhere by it.

`open()` of a FIFO blocks until a writer comes, and a daemon's scan that opens one never returns: nothing
else under ROOT is then exported. Opened with O_NONBLOCK, anything but a regular file is an OSError
(EINVAL) its caller already turns into its own named error; a regular file reads as usual.

A directory the daemon journaled (a staged step) may later be replaced by a symbolic link, or have a part
of it replaced (`model/`, `export/`, its marker): everything read, written or deleted through it would then
be outside ROOT. `refuse_links` opens the directory with O_NOFOLLOW and looks at its parts from that
descriptor (without following them), so each part checked is one of that very directory.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterable
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


def linked(path: Path, why: str, hint: str) -> SymlinkError:
    try:
        target = f" (-> {os.readlink(path)})"
    except OSError:
        target = ""
    return SymlinkError(f"is a symbolic link{target}; {why}", path=path, hint=hint)


def refuse_links(
    directory: str | os.PathLike[str], parts: Iterable[str] = (), *, why: str, hint: str
) -> bool:
    """`SymlinkError` if `directory` or any of `parts` (names in it) that exists is a symbolic link; True
    when the directory is there and real, False when it is gone (its caller names that its own way)."""
    directory = Path(directory)
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR) and os.path.islink(directory):
            raise linked(directory, why, hint) from None
        raise
    try:
        for part in parts:
            try:
                st = os.stat(part, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                continue
            if stat.S_ISLNK(st.st_mode):
                raise linked(directory / part, why, hint)
    finally:
        os.close(fd)
    return True
