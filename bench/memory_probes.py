"""What the benchmarks ask of the host's memory: how much free memory the kernel has handed back to the
host (a VM's free page reporting), waiting until that settles, and the pinned device-to-host copy peak."""

from __future__ import annotations

import time
from pathlib import Path

REPORTED = Path("/sys/module/page_reporting/parameters/reported_kib")


def reported_kib() -> int:
    """KiB of free memory reported to the host so far (0 where the kernel does not report)."""
    return int(REPORTED.read_text()) if REPORTED.exists() else 0


def settle(timeout: float = 40.0, *, without: float = 2.0) -> None:
    """Wait until the kernel has handed the memory freed so far back to the host (its `page_reporting`
    count stops growing): a daemon's steady state, where the last big free was seconds ago. Where the
    kernel does not report, sleep `without` seconds instead."""
    if not REPORTED.exists():
        time.sleep(without)
        return
    end, last, still = time.monotonic() + timeout, -1, 0
    while time.monotonic() < end and still < 3:
        now = reported_kib()
        still = still + 1 if now == last else 0
        last = now
        time.sleep(1)


def pinned_peak(nbytes: int) -> float | None:
    """GB/s of one large device-to-host copy into a pinned buffer, best of 3; None without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    src = torch.ones(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty(nbytes // 2, dtype=torch.bfloat16, pin_memory=True)
    best = float("inf")
    for _ in range(3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    del src, dst
    return nbytes / best / 1e9
