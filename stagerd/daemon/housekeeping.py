"""Housekeeping: retention (published steps beyond `keep_last` go to the trash, then away), the disk
check and the gauges, every `disk_check_seconds` and whenever a step publishes."""

from __future__ import annotations

import asyncio
import contextlib

from stagerd.daemon.health import Health
from stagerd.daemon.journal import PUBLISHED, RETIRED
from stagerd.daemon.retention import StepView, empty_trash, move_to_trash, plan_retention
from stagerd.daemon.state import log
from stagerd.errors import JournalError, StagerdError


class Housekeeping(Health):
    async def _retain(self) -> None:
        """Delete the staged data that retention allows, oldest first."""
        if self.settings.keep_last is None:
            return
        rows = await self._j(self._journal.steps, include_retired=False)
        views = [StepView(r.step, r.state == PUBLISHED) for r in rows]
        by_step = {r.step: r for r in rows}
        for step in plan_retention(views, self.settings.keep_last):
            if self._stopping:
                return
            row = by_step[step]
            await self._trash(move_to_trash, self.root, row.path)
            await self._j(self._journal.retire, step, f"retention: keep_last={self.settings.keep_last}")
            self._log_step(
                step, None, RETIRED, note=f"staged data deleted (keep_last={self.settings.keep_last})"
            )
        await self._trash(empty_trash, self.root)

    async def _housekeeping(self) -> None:
        """Disk check, retention and gauges: every `disk_check_seconds`, and whenever a step publishes."""
        while not self._stopping:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._housekeep.wait(), timeout=self.settings.disk_check_seconds)
            self._housekeep.clear()
            await self._check_state_files()
            if self._stopping:
                return
            try:
                if not self._journal_backing_off():
                    await self._retain()
                await self._check_disk()
                await self._try_refresh()
            except JournalError as e:
                self._journal_down(e, "apply retention")
            except (OSError, StagerdError) as e:
                log.warning("housekeeping failed: %s", e)
