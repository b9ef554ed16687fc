"""Health: the disk check, the gauges and systemd status line from the journal, the loop heartbeat and
`/healthz`."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from stagerd.daemon.gate import JournalGate
from stagerd.daemon.journal import COMMITTED, FAILED, PENDING, PUBLISHED, QUARANTINED, RETIRED
from stagerd.daemon.retention import disk_state
from stagerd.daemon.state import log
from stagerd.errors import JournalError, StateGoneError
from stagerd.ops import notify

HEALTH_STALE_SECONDS = 15.0


class Health(JournalGate):
    async def _check_disk(self) -> None:
        s = self.settings
        disk = await self._io(
            disk_state, self.root, low_percent=s.low_disk_free_percent, low_bytes=s.low_disk_free_bytes
        )
        if disk.low and (self._disk is None or not self._disk.low):
            log.warning(
                "low disk on %s: %.1f GB free (%.1f%%); unpublished steps are never deleted, so publishing "
                "must catch up or space must be freed",
                self.root,
                disk.free / 1e9,
                disk.free_percent,
                extra={"disk_free": disk.free, "disk_low": True},
            )
        elif not disk.low and self._disk is not None and self._disk.low:
            log.info("disk space on %s recovered: %.1f GB free", self.root, disk.free / 1e9)
        self._disk = disk
        self.metrics.disk_free.set(disk.free)
        self.metrics.disk_low.set(int(disk.low))
        self._health.update(disk_free=disk.free, disk_low=disk.low)

    async def _check_state_files(self) -> None:
        """Stop if the journal or the lock under ROOT/.stagerd was deleted or replaced under us.

        The daemon would go on writing a journal nobody can read (`status` says there is none), and a
        second `watch` would find no lock and start beside it.
        """
        why = await self._io(lambda: self._journal.lost() or self._root_lock.lost())
        if why is None or self._fatal is not None:
            return
        err = StateGoneError(f"{why}; stopping", path=self.root)
        log.error("%s: %s", err.name, err, extra={"state": "stopping", "hint": err.hint})
        self._fatal = err
        self._health["status"] = "error"
        self._health["error"] = f"{err.name}: {err}"
        notify.notify_status(f"STOPPED: {why}")
        self._stopping = True
        self._stop.set()
        self._wake.set()

    async def _refresh(self) -> None:
        """Refresh gauges, the health snapshot and the systemd status line from the journal."""
        j = self._journal
        counts = await self._j(j.counts)
        lane_counts = await self._j(j.lane_counts)
        rows = await self._j(j.steps, include_retired=False)
        # every lane: a sink's raw lane (--publish-raw) fails and is quarantined on its own
        lanes = [*self._sinks, *self._raw_sinks]
        self.metrics.set_counts(counts, lane_counts, lanes)
        self.metrics.queue_depth.labels(stage="export", sink="").set(counts[COMMITTED] + counts[FAILED])
        for sink in lanes:
            waiting = lane_counts.get((sink, PENDING), 0) + lane_counts.get((sink, FAILED), 0)
            self.metrics.queue_depth.labels(stage="publish", sink=sink).set(waiting)
        unpublished = [r.marker_mtime for r in rows if r.state not in (PUBLISHED, RETIRED)]
        self.metrics.oldest_unpublished.set(time.time() - min(unpublished) if unpublished else 0.0)
        self._health["steps"] = counts
        to_export = counts[COMMITTED] + counts[FAILED]
        to_publish = sum(lane_counts.get((s, PENDING), 0) + lane_counts.get((s, FAILED), 0) for s in lanes)
        # a sink down shows here, not only as work waiting
        retrying = counts[FAILED] + sum(n for (_, state), n in lane_counts.items() if state == FAILED)
        held = sum(n for (_, state), n in lane_counts.items() if state == QUARANTINED)
        notify.notify_status(
            f"{counts[PUBLISHED] + counts[RETIRED]} published, {to_export} to export, "
            f"{to_publish} to publish, {counts[QUARANTINED]} quarantined"
            + (f", {retrying} retrying after a failure" if retrying else "")
            + (f", {held} sink lane(s) quarantined" if held else "")
            + (", LOW DISK" if self._disk is not None and self._disk.low else "")
        )

    async def _try_refresh(self) -> None:
        """`_refresh`, unless stopping or the journal is backing off; a journal error starts a backoff."""
        if self._stopping or self._journal_backing_off():
            return
        try:
            await self._refresh()
        except JournalError as e:
            self._journal_down(e, "read the journal")

    async def _ticker(self) -> None:
        """Loop heartbeat for /healthz, and systemd watchdog pings at half the watchdog interval."""
        wd = notify.watchdog_interval()
        period = min(1.0, wd / 2) if wd else 1.0
        while True:
            self._beat = time.monotonic()
            if wd:
                notify.notify_watchdog()
            await asyncio.sleep(period)

    def _healthz(self) -> tuple[bool, dict[str, Any]]:
        """Called from the metrics thread: healthy while the loop beats."""
        age = time.monotonic() - self._beat
        body = {**self._health, "loop_lag_seconds": round(age, 3)}
        ok = age < HEALTH_STALE_SECONDS and body.get("status") in ("ok", "stopping")
        return ok, body
