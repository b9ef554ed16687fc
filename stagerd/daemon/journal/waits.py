"""What fleet steps wait for, kept in the journal's meta beside their states (`stagerd status` shows it)."""

from __future__ import annotations

import json
import sqlite3

from stagerd.daemon.journal.schema import PUBLISHED, QUARANTINED, RETIRED
from stagerd.daemon.journal.store import LANE_WAIT, WAIT, JournalStore

_OVER = "SELECT step FROM steps WHERE state IN (?, ?)"


class FleetWaits(JournalStore):
    def set_wait(self, step: int, text: str | None, sink: str | None = None) -> None:
        """What a fleet step waits for as it happens ("waiting for node 1 (seen: ...)"); None: it does not.
        `sink`: the wait of the step's lane for that sink, apart from the export's and each other lane's.

        Kept beside the step's state rather than as one: the step stays exporting, or failed with its
        `FleetWaitError`, while `stagerd status` shows what it waits for."""
        key = f"{WAIT}{step}" if sink is None else f"{LANE_WAIT}{step}:{sink}"
        with self._tx() as c:
            if text:
                c.execute("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", (key, json.dumps(text)))
            else:
                c.execute("DELETE FROM meta WHERE key = ?", (key,))

    @staticmethod
    def _clear_waits(c: sqlite3.Connection, step: int, sink: str | None = None) -> None:
        """The step's waits (`sink`: that lane's alone) are over: it was quarantined or retired."""
        if sink is None:
            c.execute(
                "DELETE FROM meta WHERE key = ? OR key LIKE ?",
                (f"{WAIT}{step}", f"{LANE_WAIT}{step}:%"),
            )
        else:
            c.execute("DELETE FROM meta WHERE key = ?", (f"{LANE_WAIT}{step}:{sink}",))

    def waits(self) -> dict[int, dict[str | None, str]]:
        """step -> {sink: what its lane waits for; None: what its export waits for}, for every fleet step
        waiting now (or left waiting by `--once`); never one of a step quarantined or retired, nor of a
        lane quarantined or published (their rows left by an older stagerd, or by a daemon killed)."""
        out: dict[int, dict[str | None, str]] = {}
        rows = self._query(
            "SELECT key, value FROM meta WHERE key LIKE ? OR key LIKE ?", (f"{WAIT}%", f"{LANE_WAIT}%")
        )
        if not rows:
            return out  # the common case: no query of a journal's every retired step
        over = {(step, None) for (step,) in self._query(_OVER, (QUARANTINED, RETIRED))}
        lanes = "SELECT step, sink FROM lanes WHERE state IN (?, ?)"
        over |= set(self._query(lanes, (QUARANTINED, PUBLISHED)))
        for k, v in rows:
            if k.startswith(WAIT):
                step, sink = int(k[len(WAIT) :]), None
            else:
                n, sink = k[len(LANE_WAIT) :].split(":", 1)
                step = int(n)
            if (step, None) not in over and (step, sink) not in over:
                out.setdefault(step, {})[sink] = json.loads(v)
        return out
