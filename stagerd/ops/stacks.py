"""What the process is doing, on request: SIGUSR1 logs each asyncio task's chain of awaits and each thread's
stack, and the process goes on. A daemon that seems stuck (a `--once` run that does not end, a step that
does not move) then says where it waits, without a debugger in the container or a restart that loses it."""

from __future__ import annotations

import logging
import signal
import sys
import threading
import traceback
from collections.abc import Iterator
from types import FrameType
from typing import Any

log = logging.getLogger("stagerd")

SIGNAL = signal.SIGUSR1
_THREAD_FRAMES = 12  # the innermost frames of each thread: where it waits, not how it started


def install() -> None:
    """Log the stacks on SIGUSR1. From the main thread only, as `signal.signal` requires: `cli.main` run
    in another thread (an embedding program's) installs nothing."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(SIGNAL, _on_signal)


def _on_signal(signum: int, frame: FrameType | None) -> None:
    log.warning("stacks on %s:\n%s", signal.Signals(signum).name, describe())


def describe() -> str:
    """Every task of this thread's running loop with its awaits, outermost first, then every thread."""
    import asyncio  # here: a command that never runs a loop does not import it for this

    lines: list[str] = []
    try:
        tasks = sorted(asyncio.all_tasks(), key=lambda t: t.get_name())
    except RuntimeError:  # no loop runs: before the daemon started, or after it stopped
        tasks = []
    for task in tasks:
        lines.append(f"task {task.get_name()}:")
        lines += [f"  {where}" for where in _awaits(task.get_coro())]
    names = {t.ident: t.name for t in threading.enumerate()}
    for ident, top in sys._current_frames().items():
        lines.append(f"thread {names.get(ident, ident)}:")
        for fs in traceback.extract_stack(top)[-_THREAD_FRAMES:]:
            lines.append(f"  {fs.filename}:{fs.lineno} in {fs.name}")
    return "\n".join(lines)


def _awaits(coro: Any) -> Iterator[str]:
    """The frames of a coroutine and of what it awaits, down to the future it waits on. A task's own
    stack (`Task.get_stack`) stops at its outermost coroutine, which says nothing of where it waits."""
    while coro is not None:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        if frame is None:  # a future (a task: named), or a coroutine that finished
            name = getattr(coro, "get_name", None)
            yield f"awaits task {name()}" if callable(name) else f"awaits {type(coro).__name__}"
            return
        yield f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}"
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
