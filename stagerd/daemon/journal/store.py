"""The journal's storage: one SQLite connection behind a lock, its transactions and its queries.

`Journal` (machine.py) adds the state machine on top, beside `FleetWaits` (waits.py), `StepVersions`
(versions.py) and `RawLanes` (raw.py).
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import fields, replace
from pathlib import Path
from typing import Any, Self

from stagerd.daemon.journal.schema import (
    COMMITTED,
    EXPORTED,
    FAILED,
    HINTLESS_VERSION,
    LOST,
    NEWER_HINT,
    PENDING,
    RETIRED,
    RETIRED_WITH_HISTORY,
    SCHEMA_VERSION,
    STEP_COUNTS,
    STEP_STATES,
    Event,
    LaneRow,
    StepRow,
    columns,
    connect,
    journal_error,
    journal_path,
    no_journal,
    remove_journal_files,
)
from stagerd.daemon.lock import file_replaced
from stagerd.errors import JournalError

# Live: not retired. Spelled as the states it is, so that SQLite looks them up by the state index
# instead of reading every retired row (`!=` cannot use an index).
_LIVE = ", ".join(f"'{s}'" for s in STEP_STATES if s != RETIRED)
WAIT = "fleet_wait:"  # meta key prefix of a fleet step's export wait, `fleet_wait:N`
# ... and of a Hub lane's, `fleet_lane_wait:N:SINK`: outside `fleet_wait:%`, whose suffix an older stagerd
# reads as a step number, so that it still reads a journal with lane waits (and shows the export's)
LANE_WAIT = "fleet_lane_wait:"


class JournalStore:
    """The journal of one ROOT. Thread-safe: one connection behind a lock (transitions are rare)."""

    def __init__(self, conn: sqlite3.Connection, path: Path, *, readonly: bool) -> None:
        self._conn = conn
        self._lock = threading.Lock()
        self.path = path
        self.readonly = readonly
        self._opened = None if readonly else os.stat(path)  # the file this connection writes
        self._counted: bool | None = None  # whether the journal keeps `step_counts`; asked once
        self._hintless = False  # a schema-2 journal, read as it is: its failures keep no hint

    @classmethod
    def open(cls, root: str | os.PathLike[str]) -> Self:
        """Open (creating if needed) the journal of `root` for the daemon that holds the ROOT lock."""
        path = journal_path(root)
        path.parent.mkdir(parents=True, exist_ok=True)
        created = not path.exists()
        try:
            conn = connect(path)
        except sqlite3.DatabaseError as e:
            if created:
                # A half-made file would read as "schema 0"; without it the next start simply creates it.
                remove_journal_files(path)
            raise journal_error(e, path, "open the journal") from None
        return cls(conn, path, readonly=False)

    @classmethod
    def open_readonly(cls, root: str | os.PathLike[str]) -> Self:
        """Open for reading only (`stagerd status`), safe while a daemon writes it."""
        path = journal_path(root)
        if not path.is_file():
            raise no_journal(root)
        try:
            conn = sqlite3.connect(
                f"{path.resolve().as_uri()}?mode=ro", uri=True, check_same_thread=False, timeout=30
            )
        except sqlite3.DatabaseError as e:
            raise journal_error(e, path, "read the journal") from None
        try:
            version = conn.execute("PRAGMA user_version").fetchone()[0]
        except sqlite3.DatabaseError as e:
            conn.close()
            raise journal_error(e, path, "read the journal") from None
        if version == HINTLESS_VERSION:  # the older daemon that writes it still runs: read it as it is
            journal = cls(conn, path, readonly=True)
            journal._hintless = True
            return journal
        if version != SCHEMA_VERSION:
            conn.close()
            if version == 0:
                raise JournalError(
                    "the journal was never set up (the first `stagerd watch` stopped before creating it); "
                    "the next `stagerd watch` sets it up",
                    path=path,
                )
            if version < SCHEMA_VERSION:
                raise JournalError(
                    f"journal schema {version}, from an older stagerd; the next `stagerd watch` on this ROOT "
                    f"upgrades it to {SCHEMA_VERSION}",
                    path=path,
                )
            raise JournalError(
                f"journal schema {version}, from a newer stagerd; this one reads {SCHEMA_VERSION}",
                path=path,
                hint=NEWER_HINT,
            )
        return cls(conn, path, readonly=True)

    def _columns(self, row: type) -> str:
        """The SELECT list of `row`'s fields; in a schema-2 journal, with no hint for any failure."""
        names = columns(row)
        return names.replace("error_hint", "NULL AS error_hint") if self._hintless else names

    @property
    def root(self) -> Path:
        """The ROOT this journal describes: wherever it is now, moved or not."""
        return self.path.parent.parent

    def _step_row(self, r: tuple[Any, ...]) -> StepRow:
        """A row with its directory under this journal's ROOT. The journal keeps only the directory's name:
        an absolute path would send a moved or copied ROOT's retention into the ROOT that now stands at
        the old place, deleting another run's unpublished steps."""
        row = StepRow(*r)
        return replace(row, path=str(self.root / Path(row.path).name))

    def lost(self) -> str | None:
        """Why the journal file at our path is not the one this connection writes any more, or None."""
        return None if self._opened is None else file_replaced(self.path, self._opened)

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    # -- plumbing ----------------------------------------------------------------------------------------

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        if self.readonly:
            raise JournalError("the journal is open read-only", path=self.path)
        with self._lock:
            try:
                self._rollback()  # a transaction a failed ROLLBACK left open would refuse BEGIN
                self._conn.execute("BEGIN IMMEDIATE")
                try:
                    yield self._conn
                    self._conn.execute("COMMIT")
                except BaseException:
                    self._rollback()
                    raise
            except sqlite3.Error as e:
                raise journal_error(e, self.path, "write the journal") from None

    def _rollback(self) -> None:
        """Roll back what is open, if anything: SQLite may already have rolled back after a full disk."""
        if self._conn.in_transaction:
            with suppress(sqlite3.Error):
                self._conn.execute("ROLLBACK")

    def _query(self, sql: str, args: Iterable[Any] = ()) -> list[tuple]:
        with self._lock:
            try:
                return self._conn.execute(sql, tuple(args)).fetchall()
            except sqlite3.DatabaseError as e:
                raise journal_error(e, self.path, "read the journal") from None

    @staticmethod
    def _event(
        c: sqlite3.Connection,
        step: int,
        sink: str | None,
        from_state: str | None,
        to_state: str,
        error_class: str | None = None,
        message: str | None = None,
        now: float | None = None,
    ) -> None:
        c.execute(
            "INSERT INTO events (ts, step, sink, from_state, to_state, error_class, message) "
            "VALUES (?, ?, ?, ?, ?, ?, ?)",
            (now if now is not None else time.time(), step, sink, from_state, to_state, error_class, message),
        )

    @staticmethod
    def _prune_history(c: sqlite3.Connection) -> None:
        """Delete the events and lanes of the retired steps older than the newest `RETIRED_WITH_HISTORY`.

        Run in the transaction that retires a step. Both deletes walk the `step` index below the cut, where
        after the first run only live steps' rows remain (a step quarantined long ago): the cost follows
        what is live, not every step ever retired.
        """
        row = c.execute(
            "SELECT step FROM steps WHERE state = ? ORDER BY step DESC LIMIT 1 OFFSET ?",
            (RETIRED, RETIRED_WITH_HISTORY),
        ).fetchone()
        if row is None:
            return
        live = f"SELECT step FROM steps WHERE state IN ({_LIVE})"
        for table in ("events", "lanes"):
            c.execute(f"DELETE FROM {table} WHERE step <= ? AND step NOT IN ({live})", (row[0],))

    def _step_state(self, c: sqlite3.Connection, step: int, allowed: tuple[str, ...]) -> str:
        row = c.execute("SELECT state FROM steps WHERE step = ?", (step,)).fetchone()
        if row is None:
            raise JournalError(f"step {step} is not in the journal", path=self.path)
        if row[0] not in allowed:
            raise JournalError(f"step {step} is {row[0]}, expected one of {allowed}", path=self.path)
        return row[0]

    def _lane_state(self, c: sqlite3.Connection, step: int, sink: str, allowed: tuple[str, ...]) -> str:
        row = c.execute("SELECT state FROM lanes WHERE step = ? AND sink = ?", (step, sink)).fetchone()
        if row is None:
            raise JournalError(f"step {step} has no lane for {sink}", path=self.path)
        if row[0] not in allowed:
            raise JournalError(
                f"step {step} on {sink} is {row[0]}, expected one of {allowed}", path=self.path
            )
        return row[0]

    # -- reading -----------------------------------------------------------------------------------------

    def steps(self, *, include_retired: bool = True) -> list[StepRow]:
        where = "" if include_retired else f"WHERE state IN ({_LIVE})"
        return [
            self._step_row(r)
            for r in self._query(f"SELECT {self._columns(StepRow)} FROM steps {where} ORDER BY step")
        ]

    def step(self, step: int) -> StepRow | None:
        rows = self._query(f"SELECT {self._columns(StepRow)} FROM steps WHERE step = ?", (step,))
        return self._step_row(rows[0]) if rows else None

    def lanes(self, step: int | None = None, *, include_retired: bool = True) -> list[LaneRow]:
        """Lanes, of one step or all; `include_retired=False`: only live steps' (a long run's journal keeps
        every retired step's lanes, which a scan, a `--once` check or `status` must not read each time)."""
        sql = f"SELECT {self._columns(LaneRow)} FROM lanes"
        args: tuple = ()
        if step is not None:
            sql, args = sql + " WHERE step = ?", (step,)
        elif not include_retired:
            sql += f" WHERE step IN (SELECT step FROM steps WHERE state IN ({_LIVE}))"
        return [LaneRow(*r) for r in self._query(sql + " ORDER BY step, sink", args)]

    def events(self, step: int | None = None) -> list[Event]:
        sql = f"SELECT {columns(Event)} FROM events"
        args: tuple = ()
        if step is not None:
            sql, args = sql + " WHERE step = ?", (step,)
        return [Event(*r) for r in self._query(sql + " ORDER BY id", args)]

    def retired_summary(self, newest: int, *, restored: bool = False) -> tuple[int, list[int]]:
        """How many retired steps a daemon published, and the numbers of the newest `newest` of them,
        ascending (never all: a long run retires tens of thousands). With `restored`, instead those
        `stagerd restore` landed, which no daemon published: retired with no `published_at`."""
        where = f"state = ? AND published_at IS {'' if restored else 'NOT '}NULL AND error_class IS NOT ?"
        return self._retired_where(where, newest)

    def lost_summary(self, newest: int) -> tuple[int, list[int]]:
        """How many adopted steps were retired unpublished because their trainer deleted the checkpoint
        before it was exported (`Journal.retire_lost`), and the newest `newest` of them, ascending."""
        return self._retired_where("state = ? AND error_class = ?", newest)

    def lost_since(self, since: float) -> int:
        """How many adopted steps were retired as lost at or after `since` (`Journal.retire_lost`)."""
        sql = "SELECT COUNT(*) FROM steps WHERE state = ? AND error_class = ? AND retired_at >= ?"
        return int(self._query(sql, (RETIRED, LOST, since))[0][0])

    def _retired_where(self, where: str, newest: int) -> tuple[int, list[int]]:
        (count,) = self._query(f"SELECT COUNT(*) FROM steps WHERE {where}", (RETIRED, LOST))[0]
        rows = self._query(
            f"SELECT step FROM steps WHERE {where} ORDER BY step DESC LIMIT ?", (RETIRED, LOST, newest)
        )
        return count, sorted(r[0] for r in rows)

    def published_since(self, since: float) -> int:
        """How many steps were published (on every sink) at or after `since`, retired ones included."""
        return int(self._query("SELECT COUNT(*) FROM steps WHERE published_at >= ?", (since,))[0][0])

    def missed(self, sinks: Iterable[str], newest: int) -> dict[str, tuple[int, list[int]]]:
        """sink -> (how many, the newest `newest` ascending) of the retired steps it never got a lane for:
        retired before the sink was configured, their staged data gone, so nothing can publish them there.
        Only steps that keep their history (lanes) can be told: the newest `RETIRED_WITH_HISTORY`."""
        out = {}
        for sink in sinks:
            rows = self._query(
                "SELECT s.step FROM steps s WHERE s.state = ? AND s.error_class IS NOT ? "
                "AND EXISTS (SELECT 1 FROM lanes l WHERE l.step = s.step) "
                "AND NOT EXISTS (SELECT 1 FROM lanes l WHERE l.step = s.step AND l.sink = ?) "
                "ORDER BY s.step",
                (RETIRED, LOST, sink),
            )
            if rows:
                out[sink] = (len(rows), [r[0] for r in rows[-newest:]])
        return out

    def known_steps(self) -> set[int]:
        return {r[0] for r in self._query("SELECT step FROM steps")}

    def next_export(self, now: float, exclude: Iterable[int] = ()) -> StepRow | None:
        """The lowest step ready to export: committed, or failed with its retry due."""
        skip = set(exclude)
        for r in self._query(
            f"SELECT {self._columns(StepRow)} FROM steps WHERE state = ? OR (state = ? AND next_try <= ?) "
            "ORDER BY step",
            (COMMITTED, FAILED, now),
        ):
            if r[0] not in skip:
                return self._step_row(r)
        return None

    def next_publish(self, sink: str, now: float, exclude: Iterable[int] = ()) -> LaneRow | None:
        """The lowest exported step whose lane on `sink` is pending, or failed with its retry due."""
        skip = set(exclude)
        cols = ", ".join(f"l.{f.name}" for f in fields(LaneRow))
        for r in self._query(
            f"SELECT {cols} FROM lanes l JOIN steps s ON s.step = l.step WHERE l.sink = ? AND s.state = ? "
            "AND (l.state = ? OR (l.state = ? AND l.next_try <= ?)) ORDER BY l.step",
            (sink, EXPORTED, PENDING, FAILED, now),
        ):
            if r[0] not in skip:
                return LaneRow(*r)
        return None

    def next_retry_time(self, lanes: Iterable[str]) -> float | None:
        """The earliest `next_try` of a failed step, or of a failed lane of `lanes` (the configured ones), to
        sleep until. A lane of a sink no longer configured is never tried: its due retry would wake the
        scheduler at once, again and again (a spinning daemon, a `--once` run that never ends)."""
        keys = list(lanes)
        among = ", ".join("?" * len(keys))
        rows = self._query(
            "SELECT MIN(t) FROM (SELECT next_try AS t FROM steps WHERE state = ? "
            f"UNION ALL SELECT next_try FROM lanes WHERE state = ? AND sink IN ({among}))",
            (FAILED, FAILED, *keys),
        )
        return rows[0][0]

    def counts(self) -> dict[str, int]:
        """Steps per state (every state present, zeros included)."""
        out: dict[str, int] = dict.fromkeys(STEP_STATES, 0)
        if self._counted is None:
            self._counted = bool(self._query("SELECT 1 FROM sqlite_master WHERE name = ?", (STEP_COUNTS,)))
        sql = (
            "SELECT state, n FROM step_counts"
            if self._counted
            else "SELECT state, COUNT(*) FROM steps GROUP BY state"
        )
        for state, n in self._query(sql):
            out[state] = n
        return out

    def lane_counts(self) -> dict[tuple[str, str], int]:
        """(sink, state) -> lanes, for lanes of steps not yet retired."""
        rows = self._query(
            "SELECT l.sink, l.state, COUNT(*) FROM lanes l JOIN steps s ON s.step = l.step "
            f"WHERE s.state IN ({_LIVE}) GROUP BY l.sink, l.state"
        )
        return {(sink, state): n for sink, state, n in rows}

    def meta(self) -> dict[str, Any]:
        rows = self._query(
            "SELECT key, value FROM meta WHERE key NOT LIKE ? AND key NOT LIKE ?",
            (f"{WAIT}%", f"{LANE_WAIT}%"),
        )
        return {k: json.loads(v) for k, v in rows}
