"""The Stager's saves in flight: the latest (a new save waits for it to finish writing: both use the same
host buffers and the same group), and those whose outcome `wait()` has not reported yet."""

from __future__ import annotations

import contextlib
import logging
import threading
import time

from stagerd.contract import commit_marker
from stagerd.training.handle import SaveHandle, outcomes

log = logging.getLogger("stagerd.stage")


class Inflight:
    def __init__(self) -> None:
        self.latest: SaveHandle | None = None
        self._unreported: list[SaveHandle] = []
        self._lock = threading.Lock()

    def add(self, handle: SaveHandle) -> SaveHandle:
        with self._lock:
            self.latest = handle
            self._unreported.append(handle)
        return handle

    def wait_previous(self, step: int) -> None:
        """Before saving `step`: wait until the latest save has finished writing, and say how long."""
        h = self.latest
        if h is None or h.done():
            return
        t0 = time.monotonic()
        h.hurry()  # the loop waits: the copy, if still running, need not leave the copy engine to it
        with contextlib.suppress(Exception):  # its failure is reported by its handle and by wait()
            h.committed.result()
        log.warning(
            "save of step %d waited %.2f s for step %d to finish writing; save less often or write faster",
            step,
            time.monotonic() - t0,
            h.step,
        )

    def report(self) -> list[commit_marker.CommitMarker]:
        """Every unreported save's marker, once all are committed; else the first failure, raised."""
        with self._lock:
            handles, self._unreported = self._unreported, []
        markers, errors = outcomes(handles)
        del handles
        if not errors:
            return markers
        for extra in errors[1:]:
            log.error("another save failed too: %s", extra)
        first, errors = errors[0], []
        try:
            raise first
        finally:  # no cycle through this frame's locals (see the refusal in Stager.save())
            del first

    def forget(self) -> None:
        """At close: a failed save's handle holds its error, whose frames may still reach the caller's
        state dict."""
        self.latest = None
        self._unreported = []
