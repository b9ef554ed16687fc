"""A `--once` run's view of each sink's outage: one run of backoff per sink, not per step.

A cron job's `--once` must end in bounded time when a sink is down. Tried per step, every step waiting for
the sink spent its own `max_attempts` tries (each with the sink's own retries inside), so the run grew
with the steps. Here a sink's failed tries count in a row whichever steps they were for, no step of the
sink starts while it backs off, and once its tries run out (`policy.gives_up_sink`) its other steps are
left for the next start without a try (`SinkDownError`), each lane failed with no next try: it waits, never
quarantined, and the next start makes it due at once, as it does a lane whose sink's bucket is missing.
A publish that lands ends the sink's outage. A running daemon keeps none of this: each step backs off on
its own for as long as the sink is down.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from stagerd.daemon.gate import JournalGate
from stagerd.daemon.journal import EXPORTED, FAILED, PENDING, Journal, LaneState
from stagerd.daemon.policy import Failure, gives_up_sink
from stagerd.errors import SinkDownError


@dataclass
class Outage:
    """One sink's failed tries in a row in this `--once` run."""

    tries: int = 0
    until: float = 0.0  # wall clock: no step of the sink starts before
    down: Failure | None = None  # the failure that ended the run's tries of the sink


class SinkOutages(JournalGate):
    _outages: dict[str, Outage]

    def _sink_tries(self, sink: str) -> int:
        """Count a failed try of `sink` and return its tries in a row. A failure that comes while the sink
        already backs off is of a try that ran beside the one that started the backoff (`publish_workers`
        above 1): the same outage seen twice, not counted again."""
        outage = self._outages.setdefault(sink, Outage())
        if time.time() >= outage.until:
            outage.tries += 1
        return outage.tries

    def _sink_failed(self, sink: str, f: Failure) -> None:
        """Back the whole sink off until the failed try's next one, or give it up for this run."""
        outage = self._outages.setdefault(sink, Outage())
        if gives_up_sink(f, self.settings):
            outage.down = f
        elif f.next_try is not None:
            outage.until = max(outage.until, f.next_try)

    def _sink_up(self, sink: str) -> None:
        self._outages.pop(sink, None)

    def _sink_waits(self, sink: str) -> bool:
        """Whether no step of `sink` may start now: it backs off, or this run gave it up."""
        outage = self._outages.get(sink)
        return outage is not None and (outage.down is not None or time.time() < outage.until)

    def down_sinks(self) -> dict[str, Failure]:
        """The sinks this run gave up, with the failure that ended their tries."""
        return {sink: o.down for sink, o in self._outages.items() if o.down is not None}

    async def _leave_for_next_start(self) -> None:
        """Each step left waiting for a sink this run gave up is failed as `SinkDownError` without a try and
        with no next try (the next start tries it); a step still exporting gets its lane once exported, and
        then this."""
        down = self.down_sinks()
        if not down:
            return
        rows = await self._j(self._journal.steps, include_retired=False)
        exported = {r.step for r in rows if r.state == EXPORTED}
        for ln in await self._j(self._journal.lanes, include_retired=False):
            f = down.get(ln.sink)
            running = (ln.step, ln.sink) in self._inflight_publishes
            due = ln.state == PENDING or (ln.state == FAILED and ln.next_try is not None)
            if f is None or running or not due:
                continue
            if ln.sink not in self._raw_sinks and ln.step not in exported:
                continue  # its export may yet be made again; its lane is written when it is
            await self._leave(ln.step, ln.sink, f, partial(leave_waiting, self._journal, raw=False))
        for key in set(down) & set(self._raw_sinks):  # a raw lane's row is made as it first begins
            busy = [s for (s, k) in self._inflight_publishes if k == key]
            while (step := await self._j(self._journal.next_raw, key, time.time(), busy)) is not None:
                await self._leave(step, key, down[key], partial(leave_waiting, self._journal, raw=True))

    async def _leave(self, step: int, sink: str, f: Failure, record: Callable[..., None]) -> None:
        err = SinkDownError(f"{sink} is down in this --once run ({f.error_class}: {f.message})")
        # from the scheduler's pass, whose journal errors are the scheduler's to handle
        await self._j(record, step, sink, err.name, err.message)
        self._log_step(
            step,
            sink,
            LaneState.FAILED,
            error_class=err.name,
            note=f"still waiting, not quarantined: {sink} is down in this --once run; the next start tries "
            "again",
        )


def leave_waiting(
    journal: Journal, step: int, sink: str, error_class: str, message: str, *, raw: bool
) -> None:
    """A lane left untried for its sink that is down: failed with no next try, as the journal records a
    publish that waits for a missing bucket; quarantined, a lane that only waits read as one for
    `stagerd retry`."""
    if raw:
        journal.add_raw_lane(step, sink)
    journal.leave_lane(step, sink, error_class, message)
