"""The journal's schema: step and lane states, the SQLite tables, the row types, and opening the file.

The state values are str enums, so the SQLite rows, `stagerd status --json` and the events table hold the
same plain strings as before the enums existed.
"""

from __future__ import annotations

import os
import sqlite3
from dataclasses import dataclass, fields
from enum import StrEnum
from pathlib import Path, PurePath

from stagerd.contract import layout
from stagerd.errors import JournalError, JournalFullError

JOURNAL_NAME = "journal.sqlite"
NEWER_HINT = (
    "run the stagerd that wrote it (or a newer one: pip install -U stagerd); this one leaves it as it is"
)
# 2: steps.marker_id (which save of the step the row is); paths are names in ROOT. 3: steps.error_hint and
# lanes.error_hint, what to do about the recorded failure (NULL in a row failed before: its class's hint)
SCHEMA_VERSION = 3
HINTLESS_VERSION = 2  # `stagerd status` reads it as it is, while the older daemon writing it runs
# The newest retired steps that keep their whole history (events and lanes): days of a run that saves
# every few minutes. An older retired step keeps its `steps` row alone: its save's identity (what a save of
# that number again is checked against), times and sizes; about 0.2 KB of the 1.5 KB a step's history
# takes, which a daemon running for months would otherwise keep for every step.
RETIRED_WITH_HISTORY = 1000
# The error class a retired step keeps when its trainer deleted its checkpoint before it was exported: it was
# never published, and nothing can publish it (`Journal.retire_lost`); not a step `stagerd restore` landed.
LOST = "CheckpointDeleted"
LOST_NOTE = "the trainer deleted its checkpoint before it was exported"
# The largest WAL kept on disk after a checkpoint: a big transaction (the first pruning of a long journal
# of an older stagerd) would otherwise leave its WAL at that size for the daemon's life.
WAL_SIZE_LIMIT = 4 << 20


class StepState(StrEnum):
    COMMITTED = "committed"
    EXPORTING = "exporting"
    EXPORTED = "exported"
    PUBLISHED = "published"
    RETIRED = "retired"
    FAILED = "failed"
    QUARANTINED = "quarantined"


class LaneState(StrEnum):
    PENDING = "pending"
    PUBLISHING = "publishing"
    PUBLISHED = "published"
    FAILED = "failed"
    QUARANTINED = "quarantined"


COMMITTED, EXPORTING, EXPORTED, RETIRED = (
    StepState.COMMITTED,
    StepState.EXPORTING,
    StepState.EXPORTED,
    StepState.RETIRED,
)
# Shared by steps and lanes; a StepState and a LaneState of the same value compare (and hash) equal.
PUBLISHED, FAILED, QUARANTINED = StepState.PUBLISHED, StepState.FAILED, StepState.QUARANTINED
PENDING, PUBLISHING = LaneState.PENDING, LaneState.PUBLISHING
STEP_STATES = tuple(StepState)
LANE_STATES = tuple(LaneState)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS steps (
    step            INTEGER PRIMARY KEY,
    path            TEXT NOT NULL,  -- the step directory's name in ROOT
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
    updated         REAL NOT NULL,
    marker_id       TEXT,
    error_hint      TEXT
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
    error_hint      TEXT,
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
-- A long run's journal is mostly retired steps: the scheduler's queries, run every second, look up the
-- few live ones by state instead of reading every step and lane ever recorded.
CREATE INDEX IF NOT EXISTS steps_state ON steps(state);
CREATE INDEX IF NOT EXISTS lanes_state ON lanes(state);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""

# Steps per state, kept by triggers in every transaction that moves a step (whichever stagerd writes it):
# the gauges read them every few seconds, and counting the rows walks every step ever retired.
STEP_COUNTS = "step_counts"
_PLUS = (
    "INSERT INTO step_counts (state, n) VALUES ({0}.state, 1) ON CONFLICT (state) DO UPDATE SET n = n + 1;"
)
_MINUS = "UPDATE step_counts SET n = n - 1 WHERE state = {0}.state;"
_COUNTS = (
    "CREATE TABLE step_counts (state TEXT PRIMARY KEY, n INTEGER NOT NULL)",
    "INSERT INTO step_counts (state, n) SELECT state, COUNT(*) FROM steps GROUP BY state",
    f"CREATE TRIGGER step_counts_insert AFTER INSERT ON steps BEGIN {_PLUS.format('NEW')} END",
    f"CREATE TRIGGER step_counts_delete AFTER DELETE ON steps BEGIN {_MINUS.format('OLD')} END",
    "CREATE TRIGGER step_counts_update AFTER UPDATE OF state ON steps WHEN OLD.state IS NOT NEW.state "
    f"BEGIN {_MINUS.format('OLD')} {_PLUS.format('NEW')} END",
)


def has_step_counts(conn: sqlite3.Connection) -> bool:
    """Whether this journal keeps `step_counts` (one set up by a stagerd from before them does not, until
    the next `stagerd watch` opens it)."""
    return conn.execute("SELECT 1 FROM sqlite_master WHERE name = ?", (STEP_COUNTS,)).fetchone() is not None


def _add_step_counts(conn: sqlite3.Connection) -> None:
    """Create `step_counts` from the rows and its triggers, in one transaction (counted once, by one)."""
    if has_step_counts(conn):
        return
    conn.execute("BEGIN IMMEDIATE")
    try:
        if not has_step_counts(conn):
            for sql in _COUNTS:
                conn.execute(sql)
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise


@dataclass(frozen=True)
class StepRow:
    """One step as the journal holds it. Times are Unix seconds."""

    step: int
    path: str
    state: StepState
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
    marker_id: str | None  # `commit_marker.marker_identity` of the save; None for a row from schema 1
    error_hint: str | None  # what to do about the failure, as its error said; None before schema 3

    def __post_init__(self) -> None:
        object.__setattr__(self, "state", StepState(self.state))


@dataclass(frozen=True)
class LaneRow:
    """One (step, sink) publish lane."""

    step: int
    sink: str
    state: LaneState
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
    error_hint: str | None

    def __post_init__(self) -> None:
        object.__setattr__(self, "state", LaneState(self.state))


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


def space_shortage(directory: str | os.PathLike[str], *, inodes_only: bool = False) -> str | None:
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


_DAMAGED = (
    "the journal is damaged: with no daemon running, move it aside (with its -wal and -shm files) and start "
    "`stagerd watch ROOT` again: it finds the staged steps again, and each sink skips what it already holds"
)
_LOCKED = (
    "another process holds the journal's write lock (an sqlite3 shell, a backup tool): end it; a running "
    "daemon goes on by itself, `stagerd status` reads it meanwhile"
)
_HINTS = {
    sqlite3.SQLITE_CORRUPT: _DAMAGED,
    sqlite3.SQLITE_NOTADB: _DAMAGED,
    sqlite3.SQLITE_BUSY: _LOCKED,
    sqlite3.SQLITE_LOCKED: _LOCKED,
}


def journal_error(e: sqlite3.Error, path: Path, doing: str) -> JournalError:
    """The named error for an SQLite failure on `path`: JournalFullError when its filesystem is full.

    SQLite reports a full disk as "database or disk is full", or as "disk I/O error" when the write that
    failed was its -shm index or an fsync, and running out of inodes as "unable to open database file" (it
    could not create its -wal or -shm); the filesystem itself decides which it was.
    """
    code = getattr(e, "sqlite_errorcode", 0) & 0xFF
    shortage = None
    if code in (sqlite3.SQLITE_FULL, sqlite3.SQLITE_IOERR):
        shortage = space_shortage(path.parent)
    elif code == sqlite3.SQLITE_CANTOPEN:
        shortage = space_shortage(path.parent, inodes_only=True)
    if shortage is None:
        return JournalError(f"cannot {doing}: {e}", path=path, hint=_HINTS.get(code))
    return JournalFullError(
        f"the disk is full ({shortage} on {path.parent}): cannot {doing} (SQLite: {e})", path=path
    )


def no_journal(root: str | os.PathLike[str]) -> JournalError:
    """ROOT has no journal: what is true of it, for `status` and `retry`. A ROOT whose `.stagerd` holds a
    lock or a journal's leftovers had a `stagerd watch` (or a restore) start there that never created its
    journal (a full disk, a stop during its start): not one that "has not run"."""
    path = journal_path(root)
    try:
        left = sorted(os.listdir(path.parent))
    except OSError:
        left = []
    hint = f"start `stagerd watch {root} --sink URL`: it creates the journal on its first start"
    if not left:
        return JournalError("no journal here: `stagerd watch` has not run on this ROOT", path=path, hint=hint)
    return JournalError(
        f"no journal yet: {path.parent} holds only {', '.join(left)}, what a `stagerd watch` or `stagerd "
        "restore` left that stopped before creating the journal (a full disk, a stop during its start)",
        path=path,
        hint=f"free space on ROOT's filesystem if it is full, then {hint[0].lower()}{hint[1:]}; nothing is "
        "lost, the daemon finds ROOT's steps again",
    )


def remove_journal_files(path: Path) -> None:
    for p in (path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")):
        p.unlink(missing_ok=True)


def columns(cls: type) -> str:
    return ", ".join(f.name for f in fields(cls))


def _upgrade(conn: sqlite3.Connection) -> None:
    """An older schema's tables -> this one's; the columns and the version move together, or neither."""
    conn.execute("BEGIN IMMEDIATE")
    version = conn.execute("PRAGMA user_version").fetchone()[0]  # another opener may have upgraded it
    if version < 2:  # schema 1 predates step identity: its rows learn theirs at the next scan
        conn.execute("ALTER TABLE steps ADD COLUMN marker_id TEXT")
        # Schema 1 kept absolute paths, which a moved or copied ROOT would still follow: names only.
        for step, old in conn.execute("SELECT step, path FROM steps").fetchall():
            conn.execute("UPDATE steps SET path = ? WHERE step = ?", (PurePath(old).name, step))
    if version < 3:  # a failure recorded before keeps no hint: readers fall back to its class's
        conn.execute("ALTER TABLE steps ADD COLUMN error_hint TEXT")
        conn.execute("ALTER TABLE lanes ADD COLUMN error_hint TEXT")
    conn.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
    conn.execute("COMMIT")


def connect(path: Path) -> sqlite3.Connection:
    """Connect, set WAL, check the schema version and create the tables; closed again on any failure."""
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=30)
    try:
        conn.execute("PRAGMA journal_mode=WAL")
        # NORMAL, not FULL: a commit survives any process crash; power loss may roll back the last few
        # transitions, which only repeats idempotent work (exports are skipped when complete, sinks
        # skip what they hold, a retired step's missing directory is noticed at start). FULL would put
        # one fsync per transition into every step's latency.
        conn.execute("PRAGMA synchronous=NORMAL")
        conn.execute(f"PRAGMA journal_size_limit={WAL_SIZE_LIMIT}")
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        if version > SCHEMA_VERSION:
            raise JournalError(
                f"written by a newer stagerd (schema {version}, this one knows {SCHEMA_VERSION})",
                path=path,
                hint=NEWER_HINT,
            )
        if 0 < version < SCHEMA_VERSION:
            _upgrade(conn)
        conn.executescript(_SCHEMA)
        _add_step_counts(conn)
        conn.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
    except BaseException:
        conn.close()
        raise
    return conn
