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

# A wait is worth a warning only where it costs the training something one would act on: at least a
# second (shorter ones are lost in a real step's own jitter; a toy run's back-to-back saves wait a few
# milliseconds) and at least a twentieth of the time between the two saves (the throughput it costs).
MATERIAL_WAIT_S = 1.0
MATERIAL_SHARE = 0.05


def material(waited: float, interval: float) -> bool:
    """Whether a save that waited `waited` seconds for the previous one, which had started `interval`
    seconds before this wait ended, slowed the training enough to say so."""
    return waited >= MATERIAL_WAIT_S and waited >= MATERIAL_SHARE * interval


class Inflight:
    def __init__(self) -> None:
        self.latest: SaveHandle | None = None
        self._latest_at = 0.0  # when the latest save started (monotonic)
        self._unreported: list[SaveHandle] = []
        self._lock = threading.Lock()

    def add(self, handle: SaveHandle) -> SaveHandle:
        with self._lock:
            self.latest = handle
            self._latest_at = time.monotonic()
            self._unreported.append(handle)
        return handle

    def wait_previous(self, step: int) -> None:
        """Before saving `step`: wait until the latest save has finished writing, and say how long (a
        warning where the wait is material, else at DEBUG)."""
        h = self.latest
        if h is None or h.done():
            return
        t0 = time.monotonic()
        h.hurry()  # the loop waits: the copy, if still running, need not leave the copy engine to it
        with contextlib.suppress(Exception):  # its failure is reported by its handle and by wait()
            h.committed.result()
        waited = time.monotonic() - t0
        level = logging.WARNING if material(waited, t0 + waited - self._latest_at) else logging.DEBUG
        log.log(
            level,
            "save of step %d waited %.2f s for step %d to finish writing; save less often or write faster",
            step,
            waited,
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
