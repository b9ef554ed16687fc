"""Filesystems that really run out: mounting a size- or inode-limited tmpfs, filling one up, a ROOT too
small for its export, and the CLI run against them.

The `tmpfs` fixture (tests/daemon/conftest.py) mounts one per test; mounting needs CAP_SYS_ADMIN, and where
it is refused the tests that need it are skipped with the reason.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from stagerd.contract import layout

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


def snapshot(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def full_root(step_dir: Path, tmpfs: Callable[..., Path], state: Path) -> Path:
    """A ROOT on a tmpfs one page larger than the staged step: the export cannot fit.

    The daemon's journal lives in ROOT/.stagerd; here that is a link to a roomy directory, so that what runs
    out is the export, not the journal (the journal's own disk filling up has its cases below)."""
    probe = tmpfs(64 << 20)
    shutil.copytree(step_dir, probe / step_dir.name)
    root = tmpfs((usage(probe)[0] + 1) * PAGE)
    state.mkdir()
    (root / layout.STATE_DIR).symlink_to(state, target_is_directory=True)
    shutil.copytree(step_dir, root / step_dir.name)
    return root


WATCH_FLAGS = ["--once", "--nice", "0", "--io-class", "none", "--metrics-port", "0"]
