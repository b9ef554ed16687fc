"""Filesystems that really run out: mounting a size- or inode-limited tmpfs, and filling one up.

The `tmpfs` fixture (tests/daemon/conftest.py) mounts one per test; mounting needs CAP_SYS_ADMIN, and where
it is refused the tests that need it are skipped with the reason.
"""

from __future__ import annotations

import errno
import os
import subprocess
from pathlib import Path

import pytest

PAGE = os.sysconf("SC_PAGE_SIZE")


def mount(d: Path, options: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(d)], capture_output=True, text=True
    )


def usage(d: Path) -> tuple[int, int]:
    """(pages, inodes) in use on the filesystem of `d`."""
    st = os.statvfs(d)
    return (st.f_blocks - st.f_bfree) * st.f_frsize // PAGE, st.f_files - st.f_ffree


def remount(d: Path, options: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{options}", str(d)], check=True, capture_output=True)


def fill(fs: Path, leave_pages: int = 0) -> Path:
    """Take every free page of the tmpfs `fs` but `leave_pages`, in one file; deleting it frees them."""
    filler = fs / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        with pytest.raises(OSError) as info:
            while True:
                os.write(fd, b"\0" * PAGE)
        assert info.value.errno == errno.ENOSPC  # the disk really is full
        os.ftruncate(fd, os.fstat(fd).st_size - leave_pages * PAGE)
    finally:
        os.close(fd)
    return filler
