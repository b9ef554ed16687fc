"""`Stager.attach(optimizer)`: the optimizer's step waits for the latest save's host copy.

The optimizer step is the one place the parameters and the optimizer state change, so a save's host
copy can run under the forward and backward that follow it, as long as the step waits for it before it
updates anything. A step pre-hook waits (`wait_staged()`), at once for a step called without a closure.
A step called with a closure runs forward and backward inside the step (Lightning, LBFGS): the hook
wraps the closure and waits after it, so the copy hides under them too; torch's optimizers call the
closure before they touch a parameter. A post-hook reserves the host buffers of the parameters and of
the optimizer state (which exists only after the first step) once, in the background, so the first save
allocates nothing. The hooks hold the Stager weakly: an optimizer must not keep it (and its process
group) alive.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

import torch
from torch.utils.hooks import RemovableHandle

from stagerd.errors import ConfigError


class Attachable(Protocol):
    _closed: bool

    def wait_staged(self, timeout: float | None = None) -> None: ...

    def _reserve(self, kind: str, tensors: Iterable[Any]) -> None: ...


def tensors_in(states: Iterable[Any]) -> list[torch.Tensor]:
    """Every tensor in an optimizer's per-parameter states."""
    return [t for s in states if isinstance(s, Mapping) for t in s.values() if isinstance(t, torch.Tensor)]


def switches_modes(optimizer: Any) -> bool:
    """Whether the optimizer has train and eval modes (schedule-free): switching them writes the
    parameters in place, with no optimizer step, so a save's copy cannot wait for the next step."""
    return callable(getattr(optimizer, "train", None))


def hooked(handle: RemovableHandle) -> bool:
    """Whether the wait hook `handle` is still registered (not removed since)."""
    return handle.id in (handle.hooks_dict_ref() or {})


def hookable(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer whose step runs its hooks: Accelerate's `AcceleratedOptimizer` (what
    `accelerator.prepare` returns) is an Optimizer made without `Optimizer.__init__`, so its step runs
    none, and the torch optimizer it wraps (`.optimizer`) steps only when the gradients are synced."""
    inner: Any = optimizer
    while not hasattr(inner, "_optimizer_step_pre_hooks"):
        inner = getattr(inner, "optimizer", None)
        if not isinstance(inner, torch.optim.Optimizer):
            raise ConfigError(
                f"cannot attach a {type(optimizer).__name__}: its step runs no optimizer hooks",
                hint="attach the torch optimizer it wraps, or call stager.wait_staged() before each step",
            )
    return inner


def install(stager: Attachable, optimizer: torch.optim.Optimizer) -> tuple[RemovableHandle, RemovableHandle]:
    """(the wait's pre-hook, the one-shot reservation's post-hook) on `optimizer`."""
    me = weakref.ref(stager)

    def wait() -> None:
        if (s := me()) is not None:
            s.wait_staged()

    def before_step(_: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """`args` are the step's own, the optimizer first; a closure is `step(closure)` or a keyword."""
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
        if closure is None:
            wait()
            return None
        wrapped = _then(closure, wait)
        if "closure" in kwargs:
            return args, {**kwargs, "closure": wrapped}
        return (args[0], wrapped, *args[2:]), kwargs

    fired: list[bool] = []

    def after_first_step(opt: torch.optim.Optimizer, *_: Any) -> None:
        if fired:  # once; the hook stays registered until close(): removing it here would change the
            return  # optimizer's hook dict while torch iterates over it
        fired.append(True)
        if (s := me()) is not None and not s._closed:
            s._reserve("model", [p for group in opt.param_groups for p in group["params"]])
            s._reserve("optim", tensors_in(opt.state.values()))

    return optimizer.register_step_pre_hook(before_step), optimizer.register_step_post_hook(after_first_step)


def _then(closure: Callable[[], Any], wait: Callable[[], None]) -> Callable[[], Any]:
    def closure_then_wait() -> Any:
        out = closure()
        wait()  # after forward and backward, before the update
        return out

    return closure_then_wait
