"""Wait for a save's host copy right before the parameters change: in the next `optimizer.step()`.

A global optimizer step pre-hook (torch's `register_optimizer_step_pre_hook`: every optimizer, however the
trainer calls it). A step called with a closure (Lightning runs forward and backward inside the step) gets
the closure wrapped, so the wait comes after the closure, under which the copy ran, and before the
update. Without a closure the hook waits at once. Disarmed after the first wait: one per save.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle


class WaitBeforeStep:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stager: Any = None
        self._handle: RemovableHandle | None = None

    def arm(self, stager: Any) -> None:
        """The next optimizer step waits for `stager`'s latest host copy."""
        with self._lock:
            self._stager = stager
            if self._handle is None:
                self._handle = register_optimizer_step_pre_hook(self._pre_step)

    def remove(self) -> None:
        with self._lock:
            self._stager = None
            if self._handle is not None:
                self._handle.remove()
                self._handle = None

    def _take(self) -> Any:
        with self._lock:
            stager, self._stager = self._stager, None
            return stager

    def _pre_step(self, optimizer: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """`args` are the step's own, the optimizer first."""
        if self._stager is None:
            return None
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
        if closure is None:
            stager = self._take()
            if stager is not None:
                stager.wait_staged()
            return None
        wrapped = self._after(closure)
        if "closure" in kwargs:
            return args, {**kwargs, "closure": wrapped}
        return (args[0], wrapped, *args[2:]), kwargs

    def _after(self, closure: Callable[[], Any]) -> Callable[[], Any]:
        def run() -> Any:
            out = closure()
            stager = self._take()
            if stager is not None:
                stager.wait_staged()
            return out

        return run
