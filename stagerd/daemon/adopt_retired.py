"""Retired adopted checkpoints and sinks added since: retention removed stagerd's export of a published
old step, never (without `--delete-adopted`) the trainer's checkpoint. A sink configured after that gets
the step exported again from the checkpoint, while it still holds the save the other sinks have and the
sink's remote retention would keep it (not exported only to be pruned there); the steps it cannot get (the
checkpoint gone, or saved again) are named once, at the start that adds it (`Discovery._say_missed`).

An adopted step whose checkpoint its trainer deleted before it was exported (the HF Trainer's
`save_total_limit` rotating it away before, or during, its export) is retired unpublished as lost
(`Journal.retire_lost`), warned once: nothing can export it again, so neither `retry` nor a later run can
mend it, and no later run counts it unpublished. Only while ROOT is still the directory the daemon
started on: an unmounted filesystem (its empty mount point left) or a ROOT replaced makes every checkpoint
look deleted, and none is lost then (`_source_gone`): the step waits, and the daemon stops (its journal
went with ROOT, `Health._check_state_files`), to export it once started again on the remounted ROOT."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from stagerd.contract.adopt.gone import gone_unexported
from stagerd.daemon.adopt import Adoption
from stagerd.daemon.journal import COMMITTED, PUBLISHED, RETIRED, StepRow
from stagerd.daemon.journal.raw import RAW_LANE_PREFIX
from stagerd.daemon.journal.schema import LOST, LOST_NOTE, RETIRED_WITH_HISTORY
from stagerd.daemon.lock import file_replaced
from stagerd.daemon.retention import empty_trash, remove_step_data
from stagerd.daemon.state import log
from stagerd.daemon.unadopted import LOST_HINT
from stagerd.errors import SourceGoneError


class RetiredAdoption(Adoption):
    _root_stat: os.stat_result  # ROOT as the daemon started on it
    _source_gone_said: bool = False

    async def _revive_missed(self) -> None:
        """At start: every retired adopted step a configured sink lacks (one whose lanes are kept: which
        sinks have it is known) goes back to `committed` where its checkpoint holds the save it was."""
        if self._adopt_root is None:
            return
        missed = await self._j(self._journal.missed, self._lane_keys(), RETIRED_WITH_HISTORY)
        known = sorted(await self._j(self._journal.known_steps))
        lacking: dict[int, list[str]] = {}
        for sink, (_, steps) in missed.items():
            store = self._prune_stores.get(sink.removeprefix(RAW_LANE_PREFIX))
            # what the sink's own retention would delete at its next publish is not exported to send there
            dropped = [s for s in steps if store is not None and not store[1].keeps(s, known)]
            if dropped:
                log.info(
                    "%s: %d retired step(s) not exported again for it, its remote retention would not keep "
                    "them (%s)",
                    sink,
                    len(dropped),
                    ", ".join(map(str, dropped[-10:])),
                )
            for step in steps:
                if step not in dropped:
                    lacking.setdefault(step, []).append(sink)
        for step, sinks in sorted(lacking.items()):
            row = await self._j(self._journal.step, step)
            if row is None or row.marker_id is None:
                continue
            if await self._io(self._adopted_identity, Path(row.path)) != row.marker_id:
                continue  # gone, or another save of the step: said by `_say_missed`
            why = f"retired; exported again from the trainer's checkpoint for {', '.join(sorted(sinks))}"
            await self._j(self._journal.revive, step, why)
            self._log_step(step, None, COMMITTED, note=why)

    async def _work_failed(self, step: int, sink: str | None, attempt: int, err: BaseException) -> None:
        """An adopted step's export failed with its checkpoint gone (whatever the export's error: a file
        vanished under it, or no directory to read): its trainer deleted it, retired as lost."""
        if sink is None and self._adopt_root is not None:
            row = await self._j(self._journal.step, step)
            if row is not None and await self._deleted_unexported(row):
                gone = await self._source_gone()
                if gone is None:
                    await self._lose(row)
                    return
                err = gone  # the step waits, failed as an outage of ROOT, and the daemon stops
        # WorkFailures follows this class in the Daemon's MRO, not among its own bases
        await super()._work_failed(step, sink, attempt, err)  # type: ignore[misc]
        if isinstance(err, SourceGoneError):
            await self._check_state_files()  # type: ignore[attr-defined]  # Health, as WorkFailures

    async def _lose_deleted(self) -> None:
        """At start: each live adopted step whose checkpoint is gone and whose export no sink got or can get
        (one an earlier run quarantined when the rotation deleted it) is retired as lost."""
        if self._adopt_root is None:
            return
        for row in await self._j(self._journal.steps, include_retired=False):
            if await self._deleted_unexported(row) and await self._source_gone() is None:
                await self._lose(row)

    async def _deleted_unexported(self, row: StepRow) -> bool:
        """The step's checkpoint is gone, no sink has any of it, and no whole export of it is left to
        publish."""
        if row.state in (PUBLISHED, RETIRED) or row.published_at is not None:
            return False
        if any(ln.state == PUBLISHED for ln in await self._j(self._journal.lanes, row.step)):
            return False
        step_dir = Path(row.path)
        return await self._io(gone_unexported, step_dir, self._work_dir(step_dir))

    async def _source_gone(self) -> SourceGoneError | None:
        """Why ROOT is not the directory the daemon started on (said once, at WARNING), or None: then a
        checkpoint gone from it was deleted, else its filesystem went (unmounted) or ROOT was replaced."""
        why = await self._io(file_replaced, self.root, self._root_stat, "directory")
        if why is None:
            return None
        err = SourceGoneError(
            f"ROOT is no longer the directory the daemon started on ({why}), so its checkpoints look "
            "deleted; no step is retired as lost",
            path=self.root,
            hint=SourceGoneError.hint,  # the step's own record says it too, not "the step was deleted"
        )
        if not self._source_gone_said:
            self._source_gone_said = True
            log.warning("%s: %s; hint: %s", err.name, err, err.hint, extra={"error_class": err.name})
        return err

    async def _lose(self, row: StepRow) -> None:
        await self._j(self._journal.retire_lost, row.step, LOST_NOTE)
        gone = (
            f"({row.path} is gone: its rotation, such as the HF Trainer's save_total_limit), so it is not "
            "published and nothing can publish it"
        )
        note = f"{LOST_NOTE} {gone}; {LOST_HINT}"
        self._log_step(row.step, None, RETIRED, error_class=LOST, note=note, level=logging.WARNING)
        work = self._work_dir(Path(row.path))  # what its export had built: nothing will finish it
        try:
            if await self._trash(remove_step_data, self.root, work):
                await self._trash(empty_trash, self.root)  # now, not at the next retention or start
        except OSError as e:
            log.warning("step %d: its partial export %s was not removed: %s", row.step, work, e.strerror or e)
