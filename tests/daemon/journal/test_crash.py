"""SIGKILL a process while it writes the journal, at random moments and inside big transactions.

A child process (`python -m tests.daemon.journal.crash_child ROOT LOG SEED`) behaves like the daemon's
journal thread, as fast as it can: it opens the journal, recovers, reconciles its sinks, then registers steps,
exports, publishes, fails, retries, quarantines, abandons and retires them through the journal's own API.
Now and then it adds or drops a sink, and `ensure_lanes` then rewrites every live step in one transaction.
Before each call it appends `{"b": n, "call": ..., "args": ...}` to LOG and fsyncs; after it, `{"e": n}`.

The test SIGKILLs it 25 times (seeded), in turn: at a random moment; a few milliseconds into a big
transaction; and the instant SQLite starts appending a big transaction to the WAL file (the WAL left behind
then holds frames after its last commit frame, which the test counts). It kills more, up to 60, until 4
kills landed inside big transactions and 2 inside a WAL write. After each kill, with the daemon's own
`Journal.open` and `recover()`:

- `PRAGMA integrity_check` is ok and no lane points at a missing step;
- the whole journal (every state, every step's and lane's event history, the meta) equals the model after
  every finished call, or after those and the one in flight: never anything between;
- every history chains from its first state to the current one through allowed moves only;
- `recover()` moves exactly the exporting steps to committed and the publishing lanes to pending.
"""

from __future__ import annotations

import json
import random
import signal
import sqlite3
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import Any

from stagerd.daemon.journal import (
    EXPORTED,
    EXPORTING,
    PUBLISHED,
    PUBLISHING,
    RETIRED,
    Journal,
    journal_path,
)
from tests.cli_helpers import REPO, clean_env
from tests.daemon.journal.crash_child import (
    BASE_SINKS,
    LANE_MOVES,
    SETUP_STEPS,
    STEP_MOVES,
    Model,
    call_journal,
)

SEED = 20240607
KILLS = 25
MAX_KILLS = 60


# -- the test -----------------------------------------------------------------------------------------------


@dataclass
class Call:
    """One journal call the child logged; `finished` once its end was logged too."""

    n: int
    call: str
    args: dict[str, Any]
    why: str
    finished: bool = False


def read_log(path: Path) -> list[Call]:
    """The calls the child logged, in order; a line the kill cut short was never acted on."""
    calls: dict[int, Call] = {}
    for line in path.read_bytes().split(b"\n")[:-1]:
        rec = json.loads(line)
        if "b" in rec:
            calls[rec["b"]] = Call(rec["b"], rec["call"], rec["args"], rec["why"])
        else:
            calls[rec["e"]].finished = True
    return list(calls.values())


def setup_journal(root: Path) -> Model:
    """Many published steps, made in-process with the same calls (no kill here), and the same model."""
    j = Journal.open(root)
    model = Model()

    def do(call: str, **args: Any) -> None:
        call_journal(j, call, args)
        model.apply(call, args)

    do("set_meta", sinks=BASE_SINKS)
    for step in range(1, SETUP_STEPS + 1):
        do("add_step", step=step)
        do("begin_export", step=step)
        do("finish_export", step=step, sinks=BASE_SINKS)
        for sink in BASE_SINKS:
            do("begin_publish", step=step, sink=sink)
            do("finish_publish", step=step, sink=sink, sinks=BASE_SINKS)
    assert Model.of(j) == model  # the model agrees with the journal before any kill
    j.close()
    return model


def start_child(root: Path, log: Path, seed: int, err: Path) -> subprocess.Popen:
    """A real `python` child running `child_main` on the journal of `root`."""
    with open(err, "wb") as stderr:
        return subprocess.Popen(
            [sys.executable, "-m", "tests.daemon.journal.crash_child", str(root), str(log), str(seed)],
            cwd=REPO,
            env=clean_env(),
            stderr=stderr,
        )


def wait_for(pred: Callable[[], bool], child: subprocess.Popen, timeout: float) -> bool:
    """Poll `pred` every half millisecond; False on timeout; fails if the child died on its own."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        assert child.poll() is None, f"the child died on its own ({child.returncode})"
        time.sleep(0.0005)
    return False


def big_call_in_flight(log: Path) -> bool:
    """The child's last log line begins a big transaction."""
    data = log.read_bytes()
    last = data[data.rfind(b"\n", 0, len(data) - 1) + 1 :]
    return b'"why": "big"' in last and b'"b"' in last


def wal_path(root: Path) -> Path:
    """SQLite's write-ahead log next to the journal."""
    return journal_path(root).with_name(journal_path(root).name + "-wal")


def kill_child(root: Path, log: Path, seed: int, err: Path, rng: random.Random, kind: str) -> None:
    """Start a child and SIGKILL it: at a `random` moment, inside a `big` transaction (a few ms after it
    began), or inside SQLite's `wal` write of one (as soon as the WAL file grows)."""
    child = start_child(root, log, seed, err)
    try:
        assert wait_for(lambda: log.exists() and log.stat().st_size > 0, child, 30), err.read_text()
        if kind != "random" and wait_for(lambda: big_call_in_flight(log), child, 5):
            if kind == "big":
                time.sleep(rng.uniform(0, 0.004))
            else:
                wal, deadline = wal_path(root), time.monotonic() + 1
                size = wal.stat().st_size
                while wal.stat().st_size <= size and time.monotonic() < deadline:
                    pass  # no sleep: the write lasts well under a millisecond
        else:
            time.sleep(rng.uniform(0, 0.2))
        assert child.poll() is None, err.read_text()
        child.send_signal(signal.SIGKILL)
    finally:
        child.kill()
        child.wait()
    assert child.returncode == -signal.SIGKILL, err.read_text()


def uncommitted_wal_frames(wal: Path) -> int:
    """Frames of the current WAL generation after its last commit frame: a transaction the kill cut off
    while SQLite was writing it out (https://www.sqlite.org/fileformat.html#the_write_ahead_log)."""
    data = wal.read_bytes() if wal.exists() else b""
    if len(data) < 32:
        return 0
    page_size, salts = struct.unpack(">I", data[8:12])[0], data[16:24]
    frames = last_commit = 0
    for off in range(32, len(data) - 24 - page_size + 1, 24 + page_size):
        if data[off + 8 : off + 16] != salts:
            break  # a frame of an earlier generation: past the end of this one
        frames += 1
        if struct.unpack(">I", data[off + 4 : off + 8])[0]:
            last_commit = frames
    return frames - last_commit


def assert_histories_chain(m: Model) -> None:
    """Every step and lane went from nothing to its state through allowed moves, skipping none."""
    # a retired step older than the newest RETIRED_WITH_HISTORY keeps its state and no history
    assert set(m.history) <= set(m.states)
    assert all(k[1] is None and m.states[k] == RETIRED for k in set(m.states) - set(m.history))
    for key, moves in m.history.items():
        allowed = STEP_MOVES if key[1] is None else LANE_MOVES
        assert moves[0][0] is None, (key, moves)
        for (_, to), (frm, _) in pairwise(moves):
            assert frm == to, f"{key} skipped from {to} to {frm}: {moves}"
        assert all(mv in allowed for mv in moves), (key, moves)
        assert moves[-1][1] == m.states[key], (key, moves)


def differences(got: Model, want: Model) -> list[str]:
    """The first few entities whose state or history differ, for a readable failure."""
    keys = sorted(set(got.states) | set(want.states), key=str)
    g, w = ({k: (m.states.get(k), m.history.get(k)) for k in keys} for m in (got, want))
    out = [f"{k}: journal {g[k]}, model {w[k]}" for k in keys if g[k] != w[k]]
    return out[:5] + ([f"meta: journal {got.meta}, model {want.meta}"] if got.meta != want.meta else [])


def check_after_kill(root: Path, calls: list[Call], model: Model) -> tuple[Model, str]:
    """Reopen as the daemon does and check everything; returns the model after recovery and which side of
    the call in flight the journal was on."""
    in_flight = [c for c in calls if not c.finished]
    assert len(in_flight) <= 1 and (not in_flight or in_flight[0] is calls[-1])
    for c in calls:
        if c.finished:
            model.apply(c.call, c.args)
    after = model.copy()
    if in_flight:
        after.apply(in_flight[0].call, in_flight[0].args)

    j = Journal.open(root)
    try:
        conn = sqlite3.connect(journal_path(root))
        assert conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
        assert conn.execute("PRAGMA foreign_key_check").fetchall() == []
        conn.close()
        got = Model.of(j)
        side = "before" if got == model else "after" if got == after else None
        assert side is not None, f"neither before nor after {in_flight}: {differences(got, model)}"
        assert_histories_chain(got)
        recovered = {(r.step, r.sink) for r in j.recover()}
        assert recovered == set(got.where(EXPORTING) + got.where(PUBLISHING, lanes=True))
        got.apply("recover", {})
        assert Model.of(j) == got  # exporting -> committed, publishing -> pending, nothing else
        assert all(j.events(step)[-1].message == "recovered after a crash" for step, _ in recovered)
    finally:
        j.close()
    return got, side


def test_sigkill_while_writing_the_journal_never_leaves_a_state_that_was_not_committed(tmp_path):
    t0 = time.monotonic()
    root = tmp_path / "root"
    model = setup_journal(root)
    rng = random.Random(SEED)
    outcome: dict[tuple[str, str], int] = {}
    inside_big = torn_commits = calls_made = 0
    i = 0
    # Past KILLS, only the kinds whose quota a loaded machine left unmet: a kill meant for SQLite's WAL write
    # can land after it when the test's process is descheduled, so the quota is met by trying again.
    while i < KILLS or (i < MAX_KILLS and (inside_big < 4 or torn_commits < 2)):
        kind = ("random", "big", "wal")[i % 3] if i < KILLS else ("wal" if torn_commits < 2 else "big")
        log = tmp_path / f"calls-{i}.jsonl"
        kill_child(root, log, SEED + i, tmp_path / f"child-{i}.err", rng, kind)
        calls = read_log(log)
        calls_made += len(calls)
        big = bool(calls) and not calls[-1].finished and calls[-1].why == "big"
        torn = uncommitted_wal_frames(wal_path(root))
        model, side = check_after_kill(root, calls, model)
        outcome[(kind, side)] = outcome.get((kind, side), 0) + 1
        inside_big += big and side == "before"
        torn_commits += torn > 0
        i += 1
    print(
        f"{i} kills after {calls_made} calls in {time.monotonic() - t0:.1f}s: {outcome}; "
        f"{inside_big} inside a big transaction, {torn_commits} with its WAL write cut short"
    )
    # The kills did land inside big transactions, and inside SQLite's own writes, not only between calls.
    assert inside_big >= 4 and torn_commits >= 2
    # and the work went on between the kills: steps the children found were published
    assert any(k[0] > SETUP_STEPS and (EXPORTED, PUBLISHED) in h for k, h in model.history.items())
