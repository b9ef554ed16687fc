"""A method's run: K-step windows, each ending in a save, every step timed; the no-save windows beside it."""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable
from typing import Any

from .model import sync_device, train_step

T0 = time.perf_counter()


def say(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f} s] {msg}", file=sys.stderr, flush=True)


def run(
    model: Any,
    optim: Any,
    x: Any,
    method: Any,
    *,
    k: int,
    saves: int,
    hidden: bool,
    step0: int,
    warm: int = 0,
) -> dict:
    """K * (saves + 1) steps, a save at the end of every K-th; per step its start and duration. `warm`
    untimed steps first: after the GPU idled (a drain, the daemon settling) its steps run up to 6% faster
    for a dozen steps, so a window measured from idle is not the sustained state a method's run is in."""
    if method is not None:
        method.saves = []
    for _ in range(warm):
        train_step(model, optim, x, None, hidden).item()
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


class Adjacent:
    """The no-save windows beside each method's run, `n` steps right before it and right after it in the
    same process and warm state: a loss against them is not a drift since a baseline measured minutes away.
    One window serves as one run's after and the next run's before, and the no-save baselines count as
    windows, so the extra steps are about one window per run."""

    def __init__(self, n: int, measure: Callable[[int], dict]) -> None:
        self.n, self._measure = n, measure
        self._fresh: dict | None = None  # the last window, if nothing has run since
        self._waiting: list[dict] = []  # the runs whose after-window is the next window

    def took(self, r: dict) -> None:
        """A no-save run ended: its first steps are the waiting runs' after, its last the next's before."""
        if not self.n:
            return
        for entry in self._waiting:
            entry["after"] = _cut(r, slice(None, self.n))
        self._waiting = []
        self._fresh = _cut(r, slice(-self.n, None))

    def before(self) -> dict | None:
        """A method's run is about to start: its windows (the after one filled in later), None if disabled."""
        if not self.n:
            return None
        if self._fresh is None:
            self.took(self._measure(self.n))
        entry = {"before": self._fresh, "after": None}
        self._waiting.append(entry)
        self._fresh = None
        return entry

    def interrupt(self) -> None:
        """Something other than training runs next (methods closing, the disk floor): the waiting runs' after
        windows are measured now, and the next run gets a window of its own."""
        if self.n and self._waiting:
            self.took(self._measure(self.n))
        self._fresh = None


def _cut(r: dict, part: slice) -> dict:
    return {"times": r["times"][part], "starts": r["starts"][part]}
