"""Which save each step is, and what an operator may re-arm: a step saved again, and `stagerd retry`.

A step's row carries the identity of the save it was found with (`commit_marker.marker_identity`). A committed
step directory whose marker is another save is a new version of that step number: a run restarted from an
earlier checkpoint saves the same numbers again, with other data. It is never ignored:

- if no sink has (or may have) a copy of the old save, the new one simply replaces it and is exported;
- otherwise the step is quarantined as a `StepConflictError` until an operator decides, since replacing a
  published step silently would change what readers of the sink already loaded. `retry` adopts the new
  save (and re-publishes it everywhere); deleting the new step directory keeps the old one.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from stagerd.daemon.journal.schema import LOST, LaneState, StepState
from stagerd.daemon.journal.waits import FleetWaits
from stagerd.errors import JournalError, StepConflictError

CONFLICT = StepConflictError.__name__
REARMED = "re-armed at start: a retryable failure that ran out of attempts"
FAILED = StepState.FAILED  # the same text as LaneState.FAILED
_NO_NEXT_TRY = "SELECT {} FROM {} WHERE state = ? AND next_try IS NULL"


class StepVersions(FleetWaits):
    def saves(self, steps: Iterable[int] | None = None) -> dict[int, tuple[float, str | None]]:
        """step -> (marker mtime, marker identity) as recorded, for `steps` (those a scan found on disk) or
        every step the journal knows: a scan's work follows ROOT's directories, not the steps ever seen."""
        sql = "SELECT step, marker_mtime, marker_id FROM steps"
        args: tuple = ()
        if steps is not None:
            sql, args = sql + " WHERE step IN (SELECT value FROM json_each(?))", (json.dumps(list(steps)),)
        return {step: (mtime, identity) for step, mtime, identity in self._query(sql, args)}

    def note_save(self, step: int, marker_mtime: float, marker_id: str) -> None:
        """The recorded save, seen again with another mtime (or for the first time by identity): no move."""
        with self._tx() as c:
            c.execute(
                "UPDATE steps SET marker_mtime = ?, marker_id = ? WHERE step = ?",
                (marker_mtime, marker_id, step),
            )

    def new_save(
        self, step: int, path: str | os.PathLike[str], marker_mtime: float, marker_id: str, old_id: str | None
    ) -> StepState | None:
        """A new save of a known step; returns the step's new state, or None while work on it is in flight."""
        now = time.time()
        with self._tx() as c:
            state = StepState(self._step_state(c, step, tuple(StepState)))
            lanes = {LaneState(s) for (s,) in c.execute("SELECT state FROM lanes WHERE step = ?", (step,))}
            if state is StepState.EXPORTING or LaneState.PUBLISHING in lanes:
                return None  # judged at the next scan, once this attempt has ended
            c.execute(
                "UPDATE steps SET path = ?, marker_mtime = ?, marker_id = ?, updated = ? WHERE step = ?",
                (Path(path).name, marker_mtime, marker_id, now, step),
            )
            (error_class,) = c.execute("SELECT error_class FROM steps WHERE step = ?", (step,)).fetchone()
            lost = state is StepState.RETIRED and error_class == LOST  # its trainer deleted it unexported
            reached = state in (StepState.PUBLISHED, StepState.RETIRED) and not lost
            reached_a_sink = reached or LaneState.PUBLISHED in lanes
            if reached_a_sink:
                message = (
                    f"step {step} was saved again (save {marker_id[:19]}) after save {(old_id or '?')[:19]} "
                    "was published; the new save is kept on disk and not published"
                )
                self._set_step(c, step, state, StepState.QUARANTINED, now, CONFLICT, message)
                return StepState.QUARANTINED
            c.execute("DELETE FROM lanes WHERE step = ?", (step,))  # none of them published anything
            c.execute("UPDATE steps SET attempts = 0, retired_at = NULL WHERE step = ?", (step,))
            message = f"a new save ({marker_id[:19]}) replaced the unpublished one; exporting it"
            self._set_step(c, step, state, StepState.COMMITTED, now, None, message)
            return StepState.COMMITTED

    def retry(self, step: int, sink: str | None = None) -> list[str]:
        """Re-arm a failed or quarantined step and its failed or quarantined lanes (only `sink`'s, if given).

        A step quarantined as a conflict adopts its new save: exported again and re-published on every
        sink. Returns what was re-armed, one line each; empty when there was nothing to retry.
        """
        now = time.time()
        done: list[str] = []
        with self._tx() as c:
            row = c.execute("SELECT state, error_class FROM steps WHERE step = ?", (step,)).fetchone()
            if row is None:
                raise JournalError(f"step {step} is not in the journal", path=self.path)
            state, error_class = StepState(row[0]), row[1]
            stuck: tuple[LaneState, ...] = (LaneState.FAILED, LaneState.QUARANTINED)
            if state in (StepState.FAILED, StepState.QUARANTINED) and sink is None:
                c.execute("UPDATE steps SET attempts = 0 WHERE step = ?", (step,))
                self._set_step(c, step, state, StepState.COMMITTED, now, None, "retry asked by an operator")
                done.append(f"step {step}: {state} -> {StepState.COMMITTED}")
                if error_class == CONFLICT:  # the new save goes everywhere, the old copies are replaced
                    stuck = (*stuck, LaneState.PUBLISHED)
            query = "SELECT sink, state FROM lanes WHERE step = ?" + (" AND sink = ?" if sink else "")
            for lane_sink, lane_state in c.execute(query, (step, sink) if sink else (step,)).fetchall():
                if LaneState(lane_state) not in stuck:
                    continue
                c.execute(
                    "UPDATE lanes SET state = ?, attempts = 0, error_class = NULL, error_message = NULL, "
                    "error_hint = NULL, next_try = NULL, updated = ? WHERE step = ? AND sink = ?",
                    (LaneState.PENDING, now, step, lane_sink),
                )
                self._event(c, step, lane_sink, lane_state, LaneState.PENDING, message="retry", now=now)
                done.append(f"step {step} on {lane_sink}: {lane_state} -> {LaneState.PENDING}")
        return done

    def rearm(self, rearmable: Callable[[str | None], bool]) -> list[tuple[int, str | None]]:
        """At start: quarantined steps and lanes whose error `rearmable` accepts -> failed, due now.

        A `--once` run gives up on a retryable failure after `max_attempts`; the next start tries again
        instead of keeping a sink outage's quarantine for good. A step or lane failed with no next try (a
        fleet step a `--once` run left waiting for other nodes) is made due now as well. Returns the
        (step, sink) re-armed.
        """
        now = time.time()
        out: list[tuple[int, str | None]] = []
        with self._tx() as c:
            waiting = [(step, None) for (step,) in c.execute(_NO_NEXT_TRY.format("step", "steps"), (FAILED,))]
            waiting += c.execute(_NO_NEXT_TRY.format("step, sink", "lanes"), (FAILED,)).fetchall()
            for table in ("steps", "lanes"):
                c.execute(
                    f"UPDATE {table} SET attempts = 0, next_try = ?, updated = ? "
                    "WHERE state = ? AND next_try IS NULL",
                    (now, now, FAILED),
                )
            out += waiting
            for step, error_class in c.execute(
                "SELECT step, error_class FROM steps WHERE state = ?", (StepState.QUARANTINED,)
            ).fetchall():
                if rearmable(error_class):
                    c.execute(
                        "UPDATE steps SET state = ?, attempts = 0, next_try = ?, updated = ? WHERE step = ?",
                        (StepState.FAILED, now, now, step),
                    )
                    self._event(
                        c, step, None, StepState.QUARANTINED, StepState.FAILED, error_class, REARMED, now
                    )
                    out.append((step, None))
            for step, sink, error_class in c.execute(
                "SELECT step, sink, error_class FROM lanes WHERE state = ?", (LaneState.QUARANTINED,)
            ).fetchall():
                if rearmable(error_class):
                    c.execute(
                        "UPDATE lanes SET state = ?, attempts = 0, next_try = ?, updated = ? "
                        "WHERE step = ? AND sink = ?",
                        (LaneState.FAILED, now, now, step, sink),
                    )
                    self._event(
                        c, step, sink, LaneState.QUARANTINED, LaneState.FAILED, error_class, REARMED, now
                    )
                    out.append((step, sink))
        return out

    def pull_in(self, latest: float) -> int:
        """Failed steps and lanes whose next try is later than `latest` -> due now; returns how many. The
        policy never sets one later than its longest delay from now: one found later was set by a clock
        that has since gone back (NTP correcting one that ran ahead, a VM resumed), and would otherwise
        hold its retry back by the whole jump."""
        now, n = time.time(), 0
        with self._tx() as c:
            for table in ("steps", "lanes"):
                n += c.execute(
                    f"UPDATE {table} SET next_try = ?, updated = ? WHERE state = ? AND next_try > ?",
                    (now, now, FAILED, latest),
                ).rowcount
        return n

    def _set_step(
        self,
        c: sqlite3.Connection,
        step: int,
        old: StepState,
        new: StepState,
        now: float,
        error_class: str | None,
        message: str,
    ) -> None:
        error = message if error_class else None
        c.execute(
            "UPDATE steps SET state = ?, error_class = ?, error_message = ?, error_hint = NULL, "
            "next_try = NULL, updated = ? WHERE step = ?",
            (new, error_class, error, now, step),
        )
        self._event(c, step, None, old, new, error_class, message, now=now)
