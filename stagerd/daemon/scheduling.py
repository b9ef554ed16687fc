"""Scheduling: start exports in step order and publishes per sink lane as slots free up, and tell a
`--once` run when everything has settled."""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path

from stagerd.daemon.journal import COMMITTED, EXPORTED, FAILED, PENDING, PUBLISHING
from stagerd.daemon.raw_tasks import RawTasks
from stagerd.daemon.state import log
from stagerd.errors import JournalError


class Scheduling(RawTasks):
    async def _schedule(self) -> None:
        """Start exports and publishes as slots free up; with `once`, return when nothing is left to do.

        While the journal backs off nothing new starts: a full journal disk costs one log line per backoff.
        """
        while not self._stop.is_set():
            await self._journal_pause()
            if self._stop.is_set():
                return
            self._wake.clear()
            try:
                if await self._schedule_pass():
                    return
            except JournalError as e:
                self._journal_down(e, "look for work")

    async def _schedule_pass(self) -> bool:
        """Start what has a free slot, then wait for a wake-up or the next retry; True when `once` is done."""
        now = time.time()
        while len(self._inflight_exports) < self.settings.export_workers and not self._journal_backing_off():
            row = await self._j(self._journal.next_export, now, self._inflight_exports)
            if row is None:
                break
            self._inflight_exports[row.step] = asyncio.create_task(self._export(row.step, Path(row.path)))
        await self._leave_for_next_start()  # the steps of a sink this --once run gave up
        for sink in self._sinks:
            if self._sink_waits(sink):
                continue
            busy = [s for (s, k) in self._inflight_publishes if k == sink]
            while len(busy) < self.settings.publish_workers and not self._journal_backing_off():
                lane = await self._j(self._journal.next_publish, sink, now, busy)
                if lane is None:
                    break
                busy.append(lane.step)
                self._inflight_publishes[(lane.step, sink)] = asyncio.create_task(
                    self._publish(lane.step, sink)
                )
        for key in self._raw_sinks:  # raw lanes need no export: they start once the step is committed
            if self._sink_waits(key):
                continue
            busy = [s for (s, k) in self._inflight_publishes if k == key]
            while len(busy) < self.settings.publish_workers and not self._journal_backing_off():
                step = await self._j(self._journal.next_raw, key, now, busy)
                if step is None:
                    break
                busy.append(step)
                self._inflight_publishes[(step, key)] = asyncio.create_task(self._publish_raw(step, key))
        idle = not self._inflight_exports and not self._inflight_publishes
        if self.settings.once and idle and await self._settled():
            return True
        timeout = 1.0
        next_try = await self._j(self._journal.next_retry_time, self._lane_keys())
        latest = time.time() + self.settings.retry_max_seconds
        if next_try is not None and next_try > latest + 1.0:  # set by a clock that has since gone back
            n = await self._j(self._journal.pull_in, latest)
            log.warning(
                "%d retr%s set past the longest retry delay from now (the clock went back, or "
                "retry_max_seconds was longer): due now",
                n,
                "ies" if n != 1 else "y",
            )
            next_try = 0.0
        if next_try is not None:
            timeout = min(timeout, max(0.0, next_try - time.time()))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), timeout=timeout)
        return False

    async def _settled(self) -> bool:
        """Nothing runs and nothing waits (not even a retry): every live step is published, quarantined, or
        failed with no next try (a fleet step left waiting for other nodes by this `--once` run).

        ROOT is scanned once more first, so that a step committed (or saved again) during the run is never
        left out of a `--once` run that then reports everything published.
        """
        if await self._scan():
            return False
        rows = await self._j(self._journal.steps, include_retired=False)
        if any(r.state == COMMITTED or (r.state == FAILED and r.next_try is not None) for r in rows):
            return False
        lanes = await self._j(self._journal.lanes, include_retired=False)
        live = {r.step for r in rows if r.state == EXPORTED}
        configured = set(self._lane_keys())  # a lane of a sink no longer configured is never worked on
        return not any(
            ln.step in live
            and ln.sink in configured
            and (ln.state in (PENDING, PUBLISHING) or (ln.state == FAILED and ln.next_try is not None))
            for ln in lanes
        )
