"""Nothing a Stager started outlives `close()` or the process (issue 17: SIGABRT at exit).

A trainer that saved through the Stager used to die at exit now and then with "terminate called without
an active exception" once the machine was busy. gloo's worker threads free a finished collective's
tensors after the caller returned, and that needs the GIL; when the last references to a process group
or its tensors go only at interpreter finalization (a reference cycle through a failed save's traceback,
a Stager nobody closed, a DeviceMesh holding the default group), such a thread is ended by pthread_exit
inside a noexcept C++ destructor on Python 3.11: std::terminate. So `Stager.close()` joins its threads
(copy, writer, committer, buffer reservation), frees its host buffers and destroys its own group last,
errors leave without cycles (see `failures`), and an exit hook closes the Stagers a process forgot and
gives gloo's threads a moment.
"""

from __future__ import annotations

import atexit
import concurrent.futures.thread  # noqa: F401  (its exit hook must be registered before ours)
import logging
import threading
import time
import weakref
from typing import Protocol

log = logging.getLogger("stagerd.stage")

# How long the exit hook lets gloo's worker threads finish what they hold (see _at_exit).
_EXIT_GRACE_SECONDS = 0.05


class Closable(Protocol):
    def close(self) -> None:
        """Wait for pending saves, then release everything, even when a save failed."""


class _State:
    open_stagers: weakref.WeakSet[Closable] = weakref.WeakSet()
    used_gloo = False


def opened(stager: Closable, *, gloo: bool) -> None:
    """Register a Stager to be closed at exit if its owner forgets."""
    _State.open_stagers.add(stager)
    _State.used_gloo = _State.used_gloo or gloo


def closed(stager: Closable) -> None:
    _State.open_stagers.discard(stager)


def _close_forgotten() -> None:
    for stager in list(_State.open_stagers):
        try:
            stager.close()
        except Exception as e:  # a save failed (close() released everything anyway); never block the exit
            log.error("closing the Stager at exit: %s", e)


def _grace() -> None:
    if _State.used_gloo:
        # A DeviceMesh keeps the default group (and gloo's threads) alive past destroy_process_group(), so
        # a pending free can land after the interpreter started finalizing. Sleeping releases the GIL so
        # that it happens now.
        time.sleep(_EXIT_GRACE_SECONDS)


# Forgotten Stagers are closed before the interpreter joins its threads, not at atexit time: by then
# concurrent.futures refuses new work, so a save still in flight could not start DCP's write. Registered
# after concurrent.futures' own hook, so it runs first (these hooks run last-in, first-out).
_register_before_threads_join = getattr(threading, "_register_atexit", atexit.register)
_register_before_threads_join(_close_forgotten)
atexit.register(_grace)
