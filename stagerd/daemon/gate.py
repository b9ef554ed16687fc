"""The journal gate: every journal call the daemon makes, and the backoff while the journal is failing.

A failing journal (a full disk, an I/O error) pauses all new work with one log line per backoff period and
`/healthz` 503; work already done is recorded by `_record`, which retries until the write lands. With
`--once` the first journal failure ends the run instead (exit 3).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Any, TypeVar

from stagerd.daemon.policy import backoff_delay
from stagerd.daemon.state import DaemonState, log
from stagerd.errors import JournalError
from stagerd.ops import notify

T = TypeVar("T")


class Abandoned(Exception):
    """A journal write given up (shutdown, `--once`, or an error retrying cannot fix): the step keeps its
    last recorded state, which the next start recovers."""


class JournalGate(DaemonState):
    def _journal_backing_off(self) -> bool:
        return time.monotonic() < self._journal_retry_at

    def _journal_down(self, err: JournalError, doing: str) -> None:
        """Count a failed journal call; the first failure of a backoff period logs it and starts the next.

        With `--once` the run ends instead (exit 3, naming the journal); the next start recovers.
        """
        self.metrics.failures.labels(stage="journal", error_class=err.name).inc()
        if self._journal_backing_off():
            return  # a call already queued when the backoff began: counted, not logged again
        self._journal_failures += 1
        delay = backoff_delay(self._journal_failures, self.settings)
        self._journal_retry_at = time.monotonic() + delay
        then = "stopping" if self.settings.once else f"journal paused for {delay:g}s"
        log.error(
            "journal: cannot %s: %s: %s; %s (what to do: %s)",
            doing,
            err.name,
            err,
            then,
            err.hint,
            extra={"error_class": err.name, "journal_failures": self._journal_failures, "hint": err.hint},
        )
        if self.settings.once:
            self._fatal = self._fatal or err
            self._stop.set()
            return
        if self._health["status"] == "ok":
            self._health["status"] = "journal unavailable"
        self._health["journal_error"] = f"{err.name}: {err}"
        notify.notify_status(f"JOURNAL UNAVAILABLE ({err.name}); retrying in {delay:g}s")

    def _journal_up(self) -> None:
        """A journal write landed: end the backoff and report healthy again."""
        if self._journal_failures == 0:
            return
        log.info("journal: writable again after %d failed attempt(s)", self._journal_failures)
        self._journal_failures = 0
        self._journal_retry_at = 0.0
        self._health.pop("journal_error", None)
        if self._health["status"] == "journal unavailable":
            self._health["status"] = "ok"

    async def _journal_pause(self) -> None:
        """Sleep out the journal backoff (a no-op outside one); shutdown cuts it short."""
        delay = self._journal_retry_at - time.monotonic()
        if delay > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), timeout=delay)

    async def _record(self, doing: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """A journal write that records work already done: retried after each backoff until it lands.

        Raises `Abandoned` at shutdown, with `--once`, or on an error retrying cannot fix.
        """
        while True:
            await self._journal_pause()
            try:
                out = await self._j(fn, *args, **kwargs)
            except JournalError as e:
                self._journal_down(e, doing)
                if self.settings.once:
                    raise Abandoned(doing) from e  # the run ends naming the journal
                if self._stopping or not e.retryable:
                    log.error("could not %s (%s: %s); the next start recovers it", doing, e.name, e)
                    raise Abandoned(doing) from e
                continue
            self._journal_up()
            return out
