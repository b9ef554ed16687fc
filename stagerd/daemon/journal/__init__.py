"""The daemon journal: one SQLite file in WAL mode, the only durable daemon state.

Per step:   committed -> exporting -> exported -> published -> retired
Per (step, sink) lane, once the step is exported:   pending -> publishing -> published
Either may go to `failed` (error class, message, attempts, next try) and back to work, or to `quarantined`
once its attempts run out. Every transition is one `BEGIN IMMEDIATE` transaction that checks the state it
leaves and appends an `events` row, so a crash leaves either the old state or the new one. A step is
`published` when every configured sink's lane is.

The transaction that retires a step also deletes the events and lanes of the retired steps older than
the newest `RETIRED_WITH_HISTORY` (their `steps` rows stay), so a daemon's journal does not grow by a
step's whole history for every step it ever saw; `step_counts`, kept by triggers, counts steps per state.

Intent is recorded before the work: a step in `exporting` or a lane in `publishing` at start means the
daemon died mid-way; `recover()` moves them back (the export engine and the sinks are idempotent).

machine.py is the state machine; schema.py holds the states, tables and rows, store.py the connection,
transactions and queries, versions.py a step saved again and `retry`, raw.py the raw step lanes,
retirement.py a step's retirement and its way back to `committed`.
"""

from __future__ import annotations

from stagerd.daemon.journal.machine import Journal
from stagerd.daemon.journal.schema import (
    COMMITTED,
    EXPORTED,
    EXPORTING,
    FAILED,
    JOURNAL_NAME,
    LANE_STATES,
    PENDING,
    PUBLISHED,
    PUBLISHING,
    QUARANTINED,
    RETIRED,
    SCHEMA_VERSION,
    STEP_STATES,
    Event,
    LaneRow,
    LaneState,
    Recovered,
    StepRow,
    StepState,
    journal_path,
)

__all__ = [
    "COMMITTED",
    "EXPORTED",
    "EXPORTING",
    "FAILED",
    "JOURNAL_NAME",
    "LANE_STATES",
    "PENDING",
    "PUBLISHED",
    "PUBLISHING",
    "QUARANTINED",
    "RETIRED",
    "SCHEMA_VERSION",
    "STEP_STATES",
    "Event",
    "Journal",
    "LaneRow",
    "LaneState",
    "Recovered",
    "StepRow",
    "StepState",
    "journal_path",
]
