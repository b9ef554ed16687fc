"""Housekeeping: retention (published steps beyond `keep_last` go to the trash, then away), the disk
check and the gauges, every `disk_check_seconds` and whenever a step publishes."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

from stagerd.contract.layout import a_few, foreign_names
from stagerd.contract.step.lock import StepLock
from stagerd.contract.step.pin import Unpinned, pinned
from stagerd.daemon.adopt import Adoption
from stagerd.daemon.discovery import save_identity
from stagerd.daemon.health import Health
from stagerd.daemon.journal import PUBLISHED, RETIRED, StepRow
from stagerd.daemon.retention import (
    StepView,
    empty_trash,
    plan_retention,
    remove_step_data,
)
from stagerd.daemon.state import log
from stagerd.errors import JournalError, MarkerError, StagerdError, StepBusyError


class Housekeeping(Health, Adoption):
    _retention_pinned: set[int]  # steps retention kept while pinned (said once)
    _retention_kept: set[int]  # steps retention kept for another save of them (said once)

    async def _retain(self) -> None:
        """Delete the staged data that retention allows, oldest first."""
        if self.settings.keep_last is None:
            return
        rows = await self._j(self._journal.steps, include_retired=False)
        # --adopt without --delete-adopted deletes exports only, never the Trainer's checkpoints
        keeps_best = self.settings.adopt is None or self.settings.delete_adopted
        best = await self._io(self._trainers_best) if keeps_best else set()
        views = [
            StepView(r.step, r.state == PUBLISHED, r.step in best or pinned(self.root, r.step)) for r in rows
        ]
        by_step = {r.step: r for r in rows}
        for v in views:
            if v.pinned and v.step not in self._retention_pinned:
                self._retention_pinned.add(v.step)
                # said once: a live pin before the newest step's record of the best, which outlives it
                why = "a trainer pins it" if pinned(self.root, v.step) else "the newest step names it best"
                log.info("step %d: kept while %s (its best model), beside the newest %d",
                         v.step, why, self.settings.keep_last)  # fmt: skip
        for step in plan_retention(views, self.settings.keep_last):
            if self._stopping:
                return
            await _whole(self._retain_step(step, by_step[step]))
        if self.settings.delete_adopted:
            await self._retain_retired_checkpoints(views, best)
        await self._trash(empty_trash, self.root, *self._set_aside_places())

    async def _retain_step(self, step: int, row: StepRow) -> None:
        """Delete one step's staged data, as retention planned, and journal it retired."""
        deleted = await self._retire_one(step, row, "staged data")
        if deleted is None:
            return
        self._retention_pinned.discard(step)
        # an operator may have moved or removed the directory by hand: say so, not that we deleted it
        what = "staged data deleted" if deleted else "its directory was already gone: nothing deleted"
        why = f"keep_last={self.settings.keep_last}"
        await self._j(self._journal.retire, step, f"retention: {why}" + ("" if deleted else f"; {what}"))
        self._log_step(step, None, RETIRED, note=f"{what} ({why})")

    async def _retain_retired_checkpoints(self, live: list[StepView], best: set[int]) -> None:
        """--delete-adopted given after retention retired steps without it: their exports went, the trainer's
        checkpoints stayed. Delete those the same plan would (beyond keep_last, published on every sink the
        daemon has now, not pinned or the trainer's best), under the same checks; the live steps' plan is
        left as it was."""
        here = await self._io(self._adopted_steps_here)
        rows = await self._j(lambda: [r for s in here if (r := self._journal.step(s)) and r.state == RETIRED])
        rows = [r for r in rows if await self._io(Path(r.path).is_dir)]
        if not rows:
            return
        keys = self._lane_keys()
        views = []
        for r in rows:
            lanes = {ln.sink: ln.state for ln in await self._j(self._journal.lanes, r.step)}
            everywhere = all(lanes.get(k) == PUBLISHED for k in keys)  # none known: kept (history pruned)
            views.append(StepView(r.step, everywhere, r.step in best or pinned(self.root, r.step)))
        by_step = {r.step: r for r in rows}
        for step in sorted(set(plan_retention([*live, *views], self.settings.keep_last)) & set(by_step)):
            if self._stopping:
                return
            await _whole(self._retain_checkpoint(step, by_step[step]))

    async def _retain_checkpoint(self, step: int, row: StepRow) -> None:
        """Delete one retired step's trainer checkpoint, as retention planned, and say so."""
        if await self._retire_one(step, row, "the trainer's checkpoint"):
            why = f"keep_last={self.settings.keep_last}, --delete-adopted; retired before without it"
            self._log_step(
                step, None, RETIRED, note=f"the trainer's checkpoint {Path(row.path).name} deleted ({why})"
            )

    async def _retire_one(self, step: int, row: StepRow, what: str) -> bool | None:
        """Retention's delete of one step's data under `_remove_published`'s checks: None where it is kept
        (said once a step), else whether anything was there to delete."""
        kept, deleted = await self._trash(self._remove_published, step, Path(row.path), row.marker_id)
        if kept is not None:
            if step not in self._retention_kept:
                self._retention_kept.add(step)
                log.warning("step %d: %s kept: %s", step, what, kept)
            return None
        self._retention_kept.discard(step)
        return deleted

    def _remove_published(self, step: int, step_dir: Path, marker_id: str | None) -> tuple[str | None, bool]:
        """Trash thread: delete what retention may of a published step, under the step's lock, and only
        while the directory still holds the save the sinks have; returns why it was kept (or None), and
        whether anything was deleted. A step deleted by hand and saved again (a run restarted from an
        earlier checkpoint) is a new save that no sink has, or one being written."""
        paths = self._retired_paths(step_dir)
        if step_dir not in paths:  # an adopted checkpoint stays: only stagerd's export of it goes
            return None, _remove_all(self.root, paths)
        lock = StepLock(self.root, step, "retention") if self._adopt_root is None else None
        try:
            if lock is not None:
                lock.acquire()
            with Unpinned(self.root, step) as free:
                if not free:
                    return "a trainer holds it (its best model, read back when training ends)", False
                return self._remove_save(step_dir, marker_id, paths)
        except StepBusyError as e:
            return str(e), False
        finally:
            if lock is not None:
                lock.release()

    def _remove_save(
        self, step_dir: Path, marker_id: str | None, paths: list[Path]
    ) -> tuple[str | None, bool]:
        """Under the step's lock: delete a published step's data while it holds the save the sinks have."""
        if step_dir.is_dir():
            try:
                ident = (
                    save_identity(step_dir) if self._adopt_root is None else self._adopted_identity(step_dir)
                )
            except (FileNotFoundError, MarkerError):
                ident = None
            if ident is None:
                return "its directory holds no committed save: a save of it may be in progress", False
            if marker_id is not None and ident != marker_id:
                return "its directory holds another save of it, made since the one the sinks hold", False
            if self._adopt_root is None and (foreign := foreign_names(step_dir)):
                return (
                    f"{step_dir} also holds {a_few(foreign)}, which no save writes: retention never deletes "
                    "your own files; move them out of it and the step goes at the next check"
                ), False
        return None, _remove_all(self.root, paths)

    def _set_aside_places(self) -> list[Path]:
        """Where retention may set a step's data aside besides ROOT: the adopted checkpoints' exports."""
        return [] if self._adopt_root is None else [self._adopt_root]

    def _retired_paths(self, step_dir: Path) -> list[Path]:
        """What retention deletes of a step: its directory; of an adopted checkpoint, stagerd's export of it,
        and the trainer's checkpoint only when `delete_adopted` says so."""
        if self._adopt_root is None:
            return [step_dir]
        return [self._work_dir(step_dir), *([step_dir] if self.settings.delete_adopted else [])]

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


def _remove_all(root: Path, paths: list[Path]) -> bool:
    """Remove each of `paths`; whether any was there to remove."""
    removed = False
    for path in paths:
        removed = remove_step_data(root, path) or removed
    return removed


async def _whole(one: Coroutine[Any, Any, None]) -> None:
    """Await one step's delete and its record together. Its thread runs on when this task is cancelled
    (`--once` ends so, then retains once more): the record is made all the same, or that last pass finds
    the directory gone and says retention deleted nothing."""
    task = asyncio.ensure_future(one)
    try:
        await asyncio.shield(task)
    except asyncio.CancelledError:
        with contextlib.suppress(Exception):
            await task
        raise
