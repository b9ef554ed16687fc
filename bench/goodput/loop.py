"""A method's run: K-step windows, each ending in a save, every step timed."""

from __future__ import annotations

import dataclasses
import sys
import time
from typing import Any

from .model import sync_device, train_step

T0 = time.perf_counter()


def say(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f} s] {msg}", file=sys.stderr, flush=True)


def run(model: Any, optim: Any, x: Any, method: Any, *, k: int, saves: int, hidden: bool, step0: int) -> dict:
    """K * (saves + 1) steps, a save at the end of every K-th; per step its start and duration."""
    if method is not None:
        method.saves = []
    times, starts = [], []
    for i in range(1, k * (saves + 1) + 1):
        t0 = time.perf_counter()
        loss = train_step(model, optim, x, method, hidden)
        if method is not None and i % k == 0 and i <= k * saves:
            if not hidden:  # off the stall's clock: what the loop queued, so the stall is the copy alone
                sync_device()
            method.save(step0 + i)
            if not hidden:
                method.settle()
        loss.item()
        starts.append(t0)
        times.append(time.perf_counter() - t0)
    if method is not None:
        method.before_step()
        method.drain()
        time.sleep(0.5)  # the done-callbacks have run; the disk settles
    say(
        f"{method.name if method else 'no saves'}: K={k}, {saves} saves, {'hidden' if hidden else 'unhidden'}"
    )
    return {
        "times": times,
        "starts": starts,
        "saves": [dataclasses.asdict(r) for r in method.saves] if method else [],
    }
