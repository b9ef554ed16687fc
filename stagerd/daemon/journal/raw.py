"""Raw step lanes (`--publish-raw`): the staged step itself, to `PREFIX/raw/step-N/` of an fsspec sink.

A raw lane is a row of the `lanes` table like any other, keyed `raw:<sink url>`, so it is retried,
quarantined, recovered after a crash, re-armed by `stagerd retry` and shown by `status` like a publish. It
differs in one way: it needs no export, so it may start as soon as the step is committed (and while it is
exporting, waiting to retry its export, or quarantined by it). Its row is created when it first begins.
A step counts as `published` only once its raw lanes are too, so local retention (which deletes published
steps only) never deletes a step whose raw publish is pending.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from stagerd.daemon.journal.schema import (
    COMMITTED,
    EXPORTED,
    EXPORTING,
    FAILED,
    PENDING,
    PUBLISHING,
    QUARANTINED,
    RETIRED,
    LaneRow,
)
from stagerd.daemon.journal.versions import StepVersions

RAW_LANE_PREFIX = "raw:"
RESTORED_NOTE = "restored by `stagerd restore` from"
# Step states in which the staged step is on disk and its raw publish may run. A quarantined step too:
# a step its node cannot export alone (node-local staging) is exactly one to back up raw; a step that is
# gone or corrupt fails its raw lane the same way, and a save that conflicts with the sink's is refused.
_RAW_STEP_STATES = (COMMITTED, EXPORTING, EXPORTED, FAILED, QUARANTINED)


def raw_lane(sink_url: str) -> str:
    """The lane key of the raw publish to `sink_url`."""
    return f"{RAW_LANE_PREFIX}{sink_url}"


def is_raw_lane(key: str) -> bool:
    return key.startswith(RAW_LANE_PREFIX)


class RawLanes(StepVersions):
    def next_raw(self, key: str, now: float, exclude: tuple[int, ...] | list[int] = ()) -> int | None:
        """The lowest live step whose raw lane `key` is absent, pending, or failed with its retry due."""
        skip = set(exclude)
        rows = self._query(
            "SELECT s.step FROM steps s LEFT JOIN lanes l ON l.step = s.step AND l.sink = ? "
            f"WHERE s.state IN ({', '.join('?' * len(_RAW_STEP_STATES))}) "
            "AND (l.state IS NULL OR l.state = ? OR (l.state = ? AND l.next_try <= ?)) ORDER BY s.step",
            (key, *_RAW_STEP_STATES, PENDING, FAILED, now),
        )
        for (step,) in rows:
            if step not in skip:
                return int(step)
        return None

    def begin_raw(self, step: int, key: str) -> int:
        """Raw lane (created pending if absent) pending|failed -> publishing; returns the attempt."""
        now = time.time()
        with self._tx() as c:
            self._step_state(c, step, _RAW_STEP_STATES)
            cur = c.execute(
                "INSERT OR IGNORE INTO lanes (step, sink, state, updated) VALUES (?, ?, ?, ?)",
                (step, key, PENDING, now),
            )
            if cur.rowcount:
                self._event(c, step, key, None, PENDING, now=now)
            old = self._lane_state(c, step, key, (PENDING, FAILED))
            c.execute(
                "UPDATE lanes SET state = ?, attempts = attempts + 1, started = ?, next_try = NULL, "
                "updated = ? WHERE step = ? AND sink = ?",
                (PUBLISHING, now, now, step, key),
            )
            self._event(c, step, key, old, PUBLISHING, now=now)
            attempts: int = c.execute(
                "SELECT attempts FROM lanes WHERE step = ? AND sink = ?", (step, key)
            ).fetchone()[0]
            return attempts

    def record_restored(self, step: int, path: str | os.PathLike[str], marker_id: str, source: str) -> None:
        """A step `stagerd restore` is landing: `retired` (never exported, published or deleted by the
        daemon), holding the identity of the marker about to be written, so a scan takes it for this
        save and never for a new one. Recorded before the marker is written."""
        now = time.time()
        with self._tx() as c:
            row = c.execute("SELECT state FROM steps WHERE step = ?", (step,)).fetchone()
            if row is None:
                c.execute(
                    "INSERT INTO steps (step, path, state, marker_mtime, found_at, retired_at, updated, "
                    "marker_id) VALUES (?, ?, ?, 0, ?, ?, ?, ?)",
                    (step, Path(path).name, RETIRED, now, now, now, marker_id),
                )
            else:
                c.execute(
                    "UPDATE steps SET path = ?, state = ?, marker_mtime = 0, marker_id = ?, retired_at = ?, "
                    "updated = ? WHERE step = ?",
                    (Path(path).name, RETIRED, marker_id, now, now, step),
                )
            message = f"{RESTORED_NOTE} {source}; not exported or published again"
            self._event(c, step, None, None if row is None else row[0], RETIRED, message=message, now=now)
            self._prune_history(c)

    def raw_lanes(self, step: int) -> list[LaneRow]:
        """The raw lanes of one step."""
        return [ln for ln in self.lanes(step) if is_raw_lane(ln.sink)]


__all__ = ["EXPORTED", "RAW_LANE_PREFIX", "RawLanes", "is_raw_lane", "raw_lane"]
