"""The end of a step's life in the journal, and its way back: retired once its staged data is gone or its
trainer deleted the checkpoint it came from, and back to `committed` when it must be exported again."""

from __future__ import annotations

import time

from stagerd.daemon.journal.raw import RawLanes
from stagerd.daemon.journal.schema import (
    COMMITTED,
    EXPORTED,
    EXPORTING,
    FAILED,
    LOST,
    PUBLISHED,
    QUARANTINED,
    RETIRED,
)


class Retirement(RawLanes):
    """Transitions into and out of `retired`, and an export redone; each one transaction."""

    def reexport(self, step: int, reason: str) -> None:
        """exported|published -> committed: the export directory vanished before every sink had it."""
        now = time.time()
        with self._tx() as c:
            old = self._step_state(c, step, (EXPORTED, PUBLISHED))
            c.execute(
                "UPDATE steps SET state = ?, attempts = 0, updated = ? WHERE step = ?", (COMMITTED, now, step)
            )
            self._event(c, step, None, old, COMMITTED, message=reason, now=now)

    def retire(self, step: int, reason: str) -> None:
        """published -> retired: its staged data is gone (moved to the trash by retention)."""
        now = time.time()
        with self._tx() as c:
            old = self._step_state(c, step, (PUBLISHED,))
            c.execute(
                "UPDATE steps SET state = ?, retired_at = ?, updated = ? WHERE step = ?",
                (RETIRED, now, now, step),
            )
            self._event(c, step, None, old, RETIRED, message=reason, now=now)
            self._clear_waits(c, step)
            self._prune_history(c)

    def retire_lost(self, step: int, reason: str) -> None:
        """Any live state -> retired, never published: an adopted step whose checkpoint its trainer deleted
        before it was exported. Nothing can send it (`retry` has nothing to export), so no later run counts
        it unpublished; it keeps `LOST` as its error class, which tells it from a restored step. One an
        earlier run quarantined (and reported) was lost then: its `retired_at` is that time."""
        now = time.time()
        with self._tx() as c:
            old = self._step_state(c, step, (COMMITTED, EXPORTING, EXPORTED, FAILED, QUARANTINED))
            (updated,) = c.execute("SELECT updated FROM steps WHERE step = ?", (step,)).fetchone()
            c.execute(
                "UPDATE steps SET state = ?, error_class = ?, error_message = ?, error_hint = NULL, "
                "next_try = NULL, retired_at = ?, updated = ? WHERE step = ?",
                (RETIRED, LOST, reason, updated if old == QUARANTINED else now, now, step),
            )
            self._event(c, step, None, old, RETIRED, LOST, reason, now=now)
            self._clear_waits(c, step)
            self._prune_history(c)

    def revive(self, step: int, reason: str) -> None:
        """retired -> committed: an adopted step exported again from the trainer's checkpoint for a sink
        added since it was retired (its lanes on the other sinks stay published)."""
        now = time.time()
        with self._tx() as c:
            old = self._step_state(c, step, (RETIRED,))
            c.execute(
                "UPDATE steps SET state = ?, attempts = 0, retired_at = NULL, updated = ? WHERE step = ?",
                (COMMITTED, now, step),
            )
            self._event(c, step, None, old, COMMITTED, message=reason, now=now)
