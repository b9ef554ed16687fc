"""The disk's floor for a save: its bytes written sequentially in one stream and fsynced."""

from __future__ import annotations

import os
import time
from pathlib import Path


def disk_floor(root: Path, nbytes: int) -> float:
    """Seconds to write `nbytes` sequentially (64 MiB writes) and fsync them: the disk's floor."""
    chunk = os.urandom(1 << 20) * 64
    path = root / "disk-floor.bin"
    os.sync()
    t0 = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        left = nbytes
        while left > 0:
            left -= f.write(memoryview(chunk)[: min(left, len(chunk))])
        os.fsync(f.fileno())
    took = time.perf_counter() - t0
    path.unlink()
    return took
