"""The daemon journal: one SQLite file in WAL mode, the only durable daemon state.

Per step:   committed -> exporting -> exported -> published -> retired
Per (step, sink) lane, once the step is exported:   pending -> publishing -> published
Either may go to `failed` (error class, message, attempts, next try) and back to work, or to `quarantined`
once its attempts run out. Every transition is one `BEGIN IMMEDIATE` transaction that checks the state it
leaves and appends an `events` row, so a crash leaves either the old state or the new one. A step is
`published` when every configured sink's lane is.

Intent is recorded before the work: a step in `exporting` or a lane in `publishing` at start means the
daemon died mid-way; `recover()` moves them back (the export engine and the sinks are idempotent).
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from stagerd.contract import layout
from stagerd.errors import JournalError, JournalFullError

JOURNAL_NAME = "journal.sqlite"
SCHEMA_VERSION = 1

COMMITTED, EXPORTING, EXPORTED, PUBLISHED, RETIRED = (
    "committed",
    "exporting",
    "exported",
    "published",
    "retired",
)
FAILED, QUARANTINED = "failed", "quarantined"
PENDING, PUBLISHING = "pending", "publishing"
STEP_STATES = (COMMITTED, EXPORTING, EXPORTED, PUBLISHED, RETIRED, FAILED, QUARANTINED)
LANE_STATES = (PENDING, PUBLISHING, PUBLISHED, FAILED, QUARANTINED)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS steps (
    step            INTEGER PRIMARY KEY,
    path            TEXT NOT NULL,
    state           TEXT NOT NULL,
    marker_mtime    REAL NOT NULL,
    found_at        REAL NOT NULL,
    attempts        INTEGER NOT NULL DEFAULT 0,
    error_class     TEXT,
    error_message   TEXT,
    next_try        REAL,
    export_started  REAL,
    export_finished REAL,
    export_seconds  REAL,
    export_bytes    INTEGER,
    tensor_bytes    INTEGER,
    export_files    INTEGER,
    export_skipped  INTEGER,
    published_at    REAL,
    retired_at      REAL,
    updated         REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS lanes (
    step            INTEGER NOT NULL REFERENCES steps(step),
    sink            TEXT NOT NULL,
    state           TEXT NOT NULL,
    attempts        INTEGER NOT NULL DEFAULT 0,
    error_class     TEXT,
    error_message   TEXT,
    next_try        REAL,
    started         REAL,
    finished        REAL,
    seconds         REAL,
    bytes_total     INTEGER,
    bytes_uploaded  INTEGER,
    location        TEXT,
    skipped         INTEGER,
    updated         REAL NOT NULL,
    PRIMARY KEY (step, sink)
);
CREATE TABLE IF NOT EXISTS events (
    id              INTEGER PRIMARY KEY AUTOINCREMENT,
    ts              REAL NOT NULL,
    step            INTEGER NOT NULL,
    sink            TEXT,
    from_state      TEXT,
    to_state        TEXT NOT NULL,
    error_class     TEXT,
    message         TEXT
);
CREATE INDEX IF NOT EXISTS events_step ON events(step);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""


@dataclass(frozen=True)
class StepRow:
    """One step as the journal holds it. Times are Unix seconds."""

    step: int
    path: str
    state: str
    marker_mtime: float
    found_at: float
    attempts: int
    error_class: str | None
    error_message: str | None
    next_try: float | None
    export_started: float | None
    export_finished: float | None
    export_seconds: float | None
    export_bytes: int | None
    tensor_bytes: int | None
    export_files: int | None
    export_skipped: int | None
    published_at: float | None
    retired_at: float | None
    updated: float


@dataclass(frozen=True)
class LaneRow:
    """One (step, sink) publish lane."""

    step: int
    sink: str
    state: str
    attempts: int
    error_class: str | None
    error_message: str | None
    next_try: float | None
    started: float | None
    finished: float | None
    seconds: float | None
    bytes_total: int | None
    bytes_uploaded: int | None
    location: str | None
    skipped: int | None
    updated: float


@dataclass(frozen=True)
class Event:
    """One recorded transition."""

    id: int
    ts: float
    step: int
    sink: str | None
    from_state: str | None
    to_state: str
    error_class: str | None
    message: str | None


@dataclass(frozen=True)
class Recovered:
    """Work that a previous daemon left in flight: moved back to a state the pipeline picks up."""

    step: int
    sink: str | None
    attempts: int


# SQLite needs room for its 32 KiB -shm index and a transaction's WAL frames. An SQLite write error with less
# than this free on the journal's filesystem is the disk filling up; with more, it is a real I/O error.
FULL_BELOW_BYTES = 1 << 20


def journal_path(root: str | os.PathLike[str]) -> Path:
    return Path(root) / layout.STATE_DIR / JOURNAL_NAME


def _space_shortage(directory: str | os.PathLike[str], *, inodes_only: bool = False) -> str | None:
    """Why the filesystem of `directory` cannot take a journal write (no inodes, too few bytes), or None."""
    try:
        st = os.statvfs(directory)
    except OSError:
        return None
    if st.f_files and st.f_favail == 0:
        return "no free inodes"
    free = st.f_bavail * st.f_frsize
    if free < FULL_BELOW_BYTES and not inodes_only:
        return f"{free} bytes free"
    return None


def _journal_error(e: sqlite3.Error, path: Path, doing: str) -> JournalError:
    """The named error for an SQLite failure on `path`: JournalFullError when its filesystem is full.

    SQLite reports a full disk as "database or disk is full", or as "disk I/O error" when the write that
    failed was its -shm index or an fsync, and running out of inodes as "unable to open database file" (it
    could not create its -wal or -shm); the filesystem itself decides which it was.
    """
    code = getattr(e, "sqlite_errorcode", 0) & 0xFF
    shortage = None
    if code in (sqlite3.SQLITE_FULL, sqlite3.SQLITE_IOERR):
        shortage = _space_shortage(path.parent)
    elif code == sqlite3.SQLITE_CANTOPEN:
        shortage = _space_shortage(path.parent, inodes_only=True)
    if shortage is None:
        return JournalError(f"cannot {doing}: {e}", path=path)
    return JournalFullError(
        f"the disk is full ({shortage} on {path.parent}): cannot {doing} (SQLite: {e})", path=path
    )


def _remove_journal_files(path: Path) -> None:
    for p in (path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")):
        p.unlink(missing_ok=True)


def _columns(cls: type) -> str:
    return ", ".join(f.name for f in fields(cls))


def _connect(path: Path) -> sqlite3.Connection:
    """Connect, set WAL, check the schema version and create the tables; closed again on any failure."""
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=30)
    try:
        conn.execute("PRAGMA journal_mode=WAL")
        # NORMAL, not FULL: a commit survives any process crash; power loss may roll back the last few
        # transitions, which only repeats idempotent work (exports are skipped when complete, sinks
        # skip what they hold, a retired step's missing directory is noticed at start). FULL would put
        # one fsync per transition into every step's latency.
        conn.execute("PRAGMA synchronous=NORMAL")
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        if version > SCHEMA_VERSION:
            raise JournalError(
                f"written by a newer stagerd (schema {version}, this one knows {SCHEMA_VERSION})", path=path
            )
        conn.executescript(_SCHEMA)
        conn.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
    except BaseException:
        conn.close()
        raise
    return conn


class Journal:
    """The journal of one ROOT. Thread-safe: one connection behind a lock (transitions are rare)."""

    def __init__(self, conn: sqlite3.Connection, path: Path, *, readonly: bool) -> None:
        self._conn = conn
        self._lock = threading.Lock()
        self.path = path
        self.readonly = readonly

    @classmethod
    def open(cls, root: str | os.PathLike[str]) -> Journal:
        """Open (creating if needed) the journal of `root` for the daemon that holds the ROOT lock."""
        path = journal_path(root)
        path.parent.mkdir(parents=True, exist_ok=True)
        created = not path.exists()
        try:
            conn = _connect(path)
        except sqlite3.DatabaseError as e:
            if created:
                # A half-made file would read as "schema 0"; without it the next start simply creates it.
                _remove_journal_files(path)
            raise _journal_error(e, path, "open the journal") from None
        return cls(conn, path, readonly=False)

    @classmethod
    def open_readonly(cls, root: str | os.PathLike[str]) -> Journal:
        """Open for reading only (`stagerd status`), safe while a daemon writes it."""
        path = journal_path(root)
        if not path.is_file():
            raise JournalError("no journal here: `stagerd watch` has not run on this ROOT", path=path)
        try:
            conn = sqlite3.connect(
                f"{path.resolve().as_uri()}?mode=ro", uri=True, check_same_thread=False, timeout=30
            )
        except sqlite3.DatabaseError as e:
            raise _journal_error(e, path, "read the journal") from None
        try:
            version = conn.execute("PRAGMA user_version").fetchone()[0]
        except sqlite3.DatabaseError as e:
            conn.close()
            raise _journal_error(e, path, "read the journal") from None
        if version != SCHEMA_VERSION:
            conn.close()
            if version == 0:
                raise JournalError(
                    "the journal was never set up (the first `stagerd watch` stopped before creating it); "
                    "the next `stagerd watch` sets it up",
                    path=path,
                )
            raise JournalError(f"journal schema {version}, this stagerd reads {SCHEMA_VERSION}", path=path)
        return cls(conn, path, readonly=True)

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
                raise _journal_error(e, self.path, "write the journal") from None

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
                raise _journal_error(e, self.path, "read the journal") from None

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
        where = "" if include_retired else f"WHERE state != '{RETIRED}'"
        return [
            StepRow(*r) for r in self._query(f"SELECT {_columns(StepRow)} FROM steps {where} ORDER BY step")
        ]

    def step(self, step: int) -> StepRow | None:
        rows = self._query(f"SELECT {_columns(StepRow)} FROM steps WHERE step = ?", (step,))
        return StepRow(*rows[0]) if rows else None

    def lanes(self, step: int | None = None) -> list[LaneRow]:
        sql = f"SELECT {_columns(LaneRow)} FROM lanes"
        args: tuple = ()
        if step is not None:
            sql, args = sql + " WHERE step = ?", (step,)
        return [LaneRow(*r) for r in self._query(sql + " ORDER BY step, sink", args)]

    def events(self, step: int | None = None) -> list[Event]:
        sql = f"SELECT {_columns(Event)} FROM events"
        args: tuple = ()
        if step is not None:
            sql, args = sql + " WHERE step = ?", (step,)
        return [Event(*r) for r in self._query(sql + " ORDER BY id", args)]

    def known_steps(self) -> set[int]:
        return {r[0] for r in self._query("SELECT step FROM steps")}

    def next_export(self, now: float, exclude: Iterable[int] = ()) -> StepRow | None:
        """The lowest step ready to export: committed, or failed with its retry due."""
        skip = set(exclude)
        for r in self._query(
            f"SELECT {_columns(StepRow)} FROM steps WHERE state = ? OR (state = ? AND next_try <= ?) "
            "ORDER BY step",
            (COMMITTED, FAILED, now),
        ):
            if r[0] not in skip:
                return StepRow(*r)
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

    def next_retry_time(self) -> float | None:
        """The earliest `next_try` of any failed step or lane, to sleep until."""
        rows = self._query(
            "SELECT MIN(t) FROM (SELECT next_try AS t FROM steps WHERE state = ? "
            "UNION ALL SELECT next_try FROM lanes WHERE state = ?)",
            (FAILED, FAILED),
        )
        return rows[0][0]

    def counts(self) -> dict[str, int]:
        """Steps per state (every state present, zeros included)."""
        out = dict.fromkeys(STEP_STATES, 0)
        for state, n in self._query("SELECT state, COUNT(*) FROM steps GROUP BY state"):
            out[state] = n
        return out

    def lane_counts(self) -> dict[tuple[str, str], int]:
        """(sink, state) -> lanes, for lanes of steps not yet retired."""
        rows = self._query(
            "SELECT l.sink, l.state, COUNT(*) FROM lanes l JOIN steps s ON s.step = l.step "
            "WHERE s.state != ? GROUP BY l.sink, l.state",
            (RETIRED,),
        )
        return {(sink, state): n for sink, state, n in rows}

    def meta(self) -> dict[str, Any]:
        return {k: json.loads(v) for k, v in self._query("SELECT key, value FROM meta")}

    # -- transitions -------------------------------------------------------------------------------------

    def set_meta(self, **values: Any) -> None:
        with self._tx() as c:
            for k, v in values.items():
                c.execute("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", (k, json.dumps(v)))

    def add_step(self, step: int, path: str | os.PathLike[str], marker_mtime: float) -> bool:
        """Record a newly found committed step; False if the journal already knows it."""
        now = time.time()
        with self._tx() as c:
            cur = c.execute(
                "INSERT OR IGNORE INTO steps (step, path, state, marker_mtime, found_at, updated) "
                "VALUES (?, ?, ?, ?, ?, ?)",
                (step, str(path), COMMITTED, marker_mtime, now, now),
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
                "error_message = NULL, next_try = NULL, updated = ? WHERE step = ?",
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
        self, step: int, error_class: str, message: str, *, next_try: float | None, quarantine: bool
    ) -> str:
        """exporting -> failed (retry at `next_try`) or quarantined; returns the new state."""
        return self._fail_step(step, (EXPORTING,), error_class, message, next_try, quarantine)

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
    ) -> str:
        now = time.time()
        new = QUARANTINED if quarantine else FAILED
        with self._tx() as c:
            old = self._step_state(c, step, allowed)
            c.execute(
                "UPDATE steps SET state = ?, error_class = ?, error_message = ?, next_try = ?, updated = ? "
                "WHERE step = ?",
                (new, error_class, message, None if quarantine else next_try, now, step),
            )
            self._event(c, step, None, old, new, error_class, message, now=now)
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
                "location = ?, skipped = ?, error_class = NULL, error_message = NULL, updated = ? "
                "WHERE step = ? AND sink = ?",
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
        done = {
            r[0] for r in c.execute("SELECT sink FROM lanes WHERE step = ? AND state = ?", (step, PUBLISHED))
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
    ) -> str:
        """lane publishing -> failed (retry at `next_try`) or quarantined; returns the new lane state."""
        return self._fail_lane(step, sink, (PUBLISHING,), error_class, message, next_try, quarantine)

    def quarantine_lane(self, step: int, sink: str, error_class: str, message: str) -> None:
        """Lane pending|failed -> quarantined (a publish that keeps killing the daemon)."""
        self._fail_lane(step, sink, (PENDING, FAILED), error_class, message, None, True)

    def _fail_lane(
        self,
        step: int,
        sink: str,
        allowed: tuple[str, ...],
        error_class: str,
        message: str,
        next_try: float | None,
        quarantine: bool,
    ) -> str:
        now = time.time()
        new = QUARANTINED if quarantine else FAILED
        with self._tx() as c:
            old = self._lane_state(c, step, sink, allowed)
            c.execute(
                "UPDATE lanes SET state = ?, error_class = ?, error_message = ?, next_try = ?, updated = ? "
                "WHERE step = ? AND sink = ?",
                (new, error_class, message, None if quarantine else next_try, now, step, sink),
            )
            self._event(c, step, sink, old, new, error_class, message, now=now)
        return new

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
