"""The journal's state machine: each transition one transaction that checks the state it leaves.

The states, tables and rows are in schema.py, the connection and queries in store.py, a step saved again
and `retry` in versions.py, raw lanes in raw.py, the end of a step's life (and its way back) in
retirement.py; the package's docstring has the lifecycle.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from stagerd.daemon.journal.retirement import Retirement
from stagerd.daemon.journal.schema import (
    COMMITTED,
    EXPORTED,
    EXPORTING,
    FAILED,
    PENDING,
    PUBLISHED,
    PUBLISHING,
    QUARANTINED,
    LaneState,
    Recovered,
    StepState,
)


class Journal(Retirement):
    """The journal's state machine: every transition checks the state it leaves, in one transaction."""

    # -- transitions -------------------------------------------------------------------------------------

    def set_meta(self, **values: Any) -> None:
        with self._tx() as c:
            for k, v in values.items():
                c.execute("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", (k, json.dumps(v)))

    def add_step(
        self, step: int, path: str | os.PathLike[str], marker_mtime: float, marker_id: str | None = None
    ) -> bool:
        """Record a newly found committed step (and which save it is); False if the journal knows it."""
        now = time.time()
        with self._tx() as c:
            cur = c.execute(
                "INSERT OR IGNORE INTO steps (step, path, state, marker_mtime, found_at, updated, marker_id) "
                "VALUES (?, ?, ?, ?, ?, ?, ?)",
                (step, Path(path).name, COMMITTED, marker_mtime, now, now, marker_id),
            )
            if cur.rowcount:
                self._event(c, step, None, None, COMMITTED, now=now)
            return bool(cur.rowcount)

    def begin_export(self, step: int) -> int:
        """committed|failed -> exporting; returns the attempt number this is."""
        now = time.time()
        with self._tx() as c:
            old = self._step_state(c, step, (COMMITTED, FAILED))
            c.execute(
                "UPDATE steps SET state = ?, attempts = attempts + 1, export_started = ?, next_try = NULL, "
                "updated = ? WHERE step = ?",
                (EXPORTING, now, now, step),
            )
            self._event(c, step, None, old, EXPORTING, now=now)
            return c.execute("SELECT attempts FROM steps WHERE step = ?", (step,)).fetchone()[0]

    def finish_export(
        self,
        step: int,
        sinks: Iterable[str],
        *,
        seconds: float,
        export_bytes: int,
        tensor_bytes: int,
        files: int,
        skipped: bool,
    ) -> None:
        """exporting -> exported, and a pending lane for every sink, in one transaction."""
        now = time.time()
        with self._tx() as c:
            old = self._step_state(c, step, (EXPORTING,))
            c.execute(
                "UPDATE steps SET state = ?, export_finished = ?, export_seconds = ?, export_bytes = ?, "
                "tensor_bytes = ?, export_files = ?, export_skipped = ?, error_class = NULL, "
                "error_message = NULL, error_hint = NULL, next_try = NULL, updated = ? WHERE step = ?",
                (EXPORTED, now, seconds, export_bytes, tensor_bytes, files, int(skipped), now, step),
            )
            self._event(c, step, None, old, EXPORTED, now=now)
            for sink in sinks:
                self._add_lane(c, step, sink, now)

    def _add_lane(self, c: sqlite3.Connection, step: int, sink: str, now: float) -> bool:
        cur = c.execute(
            "INSERT OR IGNORE INTO lanes (step, sink, state, updated) VALUES (?, ?, ?, ?)",
            (step, sink, PENDING, now),
        )
        if cur.rowcount:
            self._event(c, step, sink, None, PENDING, now=now)
        return bool(cur.rowcount)

    def fail_export(
        self,
        step: int,
        error_class: str,
        message: str,
        *,
        next_try: float | None,
        quarantine: bool,
        hint: str | None = None,
    ) -> StepState:
        """exporting -> failed (retry at `next_try`) or quarantined; returns the new state. `hint`: what to
        do, as the error said it for this case (None: its class's hint is all there is)."""
        return self._fail_step(step, (EXPORTING,), error_class, message, next_try, quarantine, hint)

    def quarantine_step(self, step: int, error_class: str, message: str) -> None:
        """Any live state -> quarantined: kept on disk, reported, never deleted, never retried."""
        self._fail_step(
            step, (COMMITTED, EXPORTING, EXPORTED, PUBLISHED, FAILED), error_class, message, None, True
        )

    def _fail_step(
        self,
        step: int,
        allowed: tuple[str, ...],
        error_class: str,
        message: str,
        next_try: float | None,
        quarantine: bool,
        hint: str | None = None,
    ) -> StepState:
        now = time.time()
        new = QUARANTINED if quarantine else FAILED
        with self._tx() as c:
            old = self._step_state(c, step, allowed)
            c.execute(
                "UPDATE steps SET state = ?, error_class = ?, error_message = ?, error_hint = ?, "
                "next_try = ?, updated = ? WHERE step = ?",
                (new, error_class, message, hint, None if quarantine else next_try, now, step),
            )
            self._event(c, step, None, old, new, error_class, message, now=now)
            if quarantine:  # by any way (a vanished step directory among them): it waits for nothing
                self._clear_waits(c, step)
        return new

    def begin_publish(self, step: int, sink: str) -> int:
        """lane pending|failed -> publishing, recorded before the sink is called; returns the attempt."""
        now = time.time()
        with self._tx() as c:
            self._step_state(c, step, (EXPORTED,))
            old = self._lane_state(c, step, sink, (PENDING, FAILED))
            c.execute(
                "UPDATE lanes SET state = ?, attempts = attempts + 1, started = ?, next_try = NULL, "
                "updated = ? WHERE step = ? AND sink = ?",
                (PUBLISHING, now, now, step, sink),
            )
            self._event(c, step, sink, old, PUBLISHING, now=now)
            return c.execute(
                "SELECT attempts FROM lanes WHERE step = ? AND sink = ?", (step, sink)
            ).fetchone()[0]

    def finish_publish(
        self,
        step: int,
        sink: str,
        *,
        sinks: Iterable[str],
        seconds: float,
        bytes_total: int,
        bytes_uploaded: int,
        location: str,
        skipped: bool,
    ) -> bool:
        """lane publishing -> published; the step becomes published once every sink in `sinks` is.

        Returns True when the step became published with this call.
        """
        now = time.time()
        with self._tx() as c:
            old = self._lane_state(c, step, sink, (PUBLISHING,))
            c.execute(
                "UPDATE lanes SET state = ?, finished = ?, seconds = ?, bytes_total = ?, bytes_uploaded = ?, "
                "location = ?, skipped = ?, error_class = NULL, error_message = NULL, error_hint = NULL, "
                "updated = ? WHERE step = ? AND sink = ?",
                (
                    PUBLISHED,
                    now,
                    seconds,
                    bytes_total,
                    bytes_uploaded,
                    location,
                    int(skipped),
                    now,
                    step,
                    sink,
                ),
            )
            self._event(c, step, sink, old, PUBLISHED, message=location, now=now)
            return self._maybe_published(c, step, sinks, now)

    def _maybe_published(self, c: sqlite3.Connection, step: int, sinks: Iterable[str], now: float) -> bool:
        wanted = set(sinks)
        # The step's lanes by its key, their states compared here: `AND state = ?` would send SQLite down
        # the state index, through every published lane ever recorded, in every publish's transaction.
        done = {
            sink
            for sink, s in c.execute("SELECT sink, state FROM lanes WHERE step = ?", (step,))
            if s == PUBLISHED
        }
        state = c.execute("SELECT state FROM steps WHERE step = ?", (step,)).fetchone()[0]
        if state == EXPORTED and wanted <= done:
            c.execute(
                "UPDATE steps SET state = ?, published_at = ?, updated = ? WHERE step = ?",
                (PUBLISHED, now, now, step),
            )
            self._event(c, step, None, EXPORTED, PUBLISHED, now=now)
            return True
        return False

    def fail_publish(
        self,
        step: int,
        sink: str,
        error_class: str,
        message: str,
        *,
        next_try: float | None,
        quarantine: bool,
        hint: str | None = None,
    ) -> LaneState:
        """lane publishing -> failed (retry at `next_try`) or quarantined; returns the new lane state."""
        return self._fail_lane(step, sink, (PUBLISHING,), error_class, message, next_try, quarantine, hint)

    def quarantine_lane(self, step: int, sink: str, error_class: str, message: str) -> None:
        """Lane pending|failed -> quarantined (a publish that keeps killing the daemon)."""
        self._fail_lane(step, sink, (PENDING, FAILED), error_class, message, None, True)

    def leave_lane(self, step: int, sink: str, error_class: str, message: str) -> None:
        """Lane pending|failed -> failed, no next try: untried, its sink down in a `--once` run (waiting)."""
        self._fail_lane(step, sink, (PENDING, FAILED), error_class, message, None, False)

    def add_raw_lane(self, step: int, key: str) -> None:
        """A raw lane, pending, where it has no row yet: its row is made as it first begins."""
        now = time.time()
        with self._tx() as c:
            added = c.execute(
                "INSERT OR IGNORE INTO lanes (step, sink, state, updated) VALUES (?, ?, ?, ?)",
                (step, key, PENDING, now),
            ).rowcount
            if added:
                self._event(c, step, key, None, PENDING, now=now)

    def _fail_lane(
        self,
        step: int,
        sink: str,
        allowed: tuple[str, ...],
        error_class: str,
        message: str,
        next_try: float | None,
        quarantine: bool,
        hint: str | None = None,
    ) -> LaneState:
        now = time.time()
        new = LaneState.QUARANTINED if quarantine else LaneState.FAILED
        with self._tx() as c:
            old = self._lane_state(c, step, sink, allowed)
            c.execute(
                "UPDATE lanes SET state = ?, error_class = ?, error_message = ?, error_hint = ?, "
                "next_try = ?, updated = ? WHERE step = ? AND sink = ?",
                (new, error_class, message, hint, None if quarantine else next_try, now, step, sink),
            )
            self._event(c, step, sink, old, new, error_class, message, now=now)
            if quarantine:
                self._clear_waits(c, step, sink)
        return new

    def recover(self) -> list[Recovered]:
        """At start: exporting -> committed and publishing -> pending, each recorded as a crash recovery."""
        now = time.time()
        out = []
        with self._tx() as c:
            for step, attempts in c.execute(
                "SELECT step, attempts FROM steps WHERE state = ?", (EXPORTING,)
            ).fetchall():
                c.execute("UPDATE steps SET state = ?, updated = ? WHERE step = ?", (COMMITTED, now, step))
                self._event(c, step, None, EXPORTING, COMMITTED, message="recovered after a crash", now=now)
                out.append(Recovered(step, None, attempts))
            for step, sink, attempts in c.execute(
                "SELECT step, sink, attempts FROM lanes WHERE state = ?", (PUBLISHING,)
            ).fetchall():
                c.execute(
                    "UPDATE lanes SET state = ?, updated = ? WHERE step = ? AND sink = ?",
                    (PENDING, now, step, sink),
                )
                self._event(c, step, sink, PUBLISHING, PENDING, message="recovered after a crash", now=now)
                out.append(Recovered(step, sink, attempts))
        return out

    def abandon(self, step: int, sink: str | None, reason: str) -> None:
        """In-flight work given up at shutdown: exporting -> committed, or lane publishing -> pending.

        The attempt is given back: a clean stop is not a failure of the step.
        """
        now = time.time()
        with self._tx() as c:
            if sink is None:
                self._step_state(c, step, (EXPORTING,))
                c.execute(
                    "UPDATE steps SET state = ?, attempts = MAX(0, attempts - 1), updated = ? WHERE step = ?",
                    (COMMITTED, now, step),
                )
                self._event(c, step, None, EXPORTING, COMMITTED, message=reason, now=now)
            else:
                self._lane_state(c, step, sink, (PUBLISHING,))
                c.execute(
                    "UPDATE lanes SET state = ?, attempts = MAX(0, attempts - 1), updated = ? "
                    "WHERE step = ? AND sink = ?",
                    (PENDING, now, step, sink),
                )
                self._event(c, step, sink, PUBLISHING, PENDING, message=reason, now=now)

    def ensure_lanes(self, sinks: Iterable[str]) -> list[tuple[int, str]]:
        """Give every exported or published (not retired) step a lane on each configured sink.

        A sink added since a step was published sends that step back to `exported` for the new lane.
        Returns the lanes added.
        """
        now = time.time()
        sinks = list(sinks)
        added = []
        with self._tx() as c:
            for step, state in c.execute(
                "SELECT step, state FROM steps WHERE state IN (?, ?)", (EXPORTED, PUBLISHED)
            ).fetchall():
                new = [s for s in sinks if self._add_lane(c, step, s, now)]
                if new and state == PUBLISHED:
                    c.execute("UPDATE steps SET state = ?, updated = ? WHERE step = ?", (EXPORTED, now, step))
                    self._event(c, step, None, PUBLISHED, EXPORTED, message=f"new sink(s): {new}", now=now)
                added += [(step, s) for s in new]
            for (step,) in c.execute("SELECT step FROM steps WHERE state = ?", (EXPORTED,)).fetchall():
                self._maybe_published(c, step, sinks, now)
        return added
