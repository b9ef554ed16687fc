"""Fixtures for the daemon's tests: a real size-limited tmpfs per test (see fullfs.py)."""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.daemon.fullfs import mount


@pytest.fixture
def tmpfs(tmp_path) -> Iterator[Callable[..., Path]]:
    """`tmpfs(size_bytes, inodes=None)`: a fresh tmpfs of that size, unmounted after the test."""
    mounted: list[Path] = []

    def make(size: int, inodes: int | None = None) -> Path:
        d = tmp_path / f"fs{len(mounted)}"
        d.mkdir()
        opts = f"size={size}" + (f",nr_inodes={inodes}" if inodes else "")
        r = mount(d, opts)
        if r.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip()}); RLIMIT_FSIZE tests still run")
        mounted.append(d)
        return d

    yield make
    for d in reversed(mounted):
        subprocess.run(["umount", "-l", str(d)], check=False)
