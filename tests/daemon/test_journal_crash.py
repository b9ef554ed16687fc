"""SIGKILL a process while it writes the journal, at random moments and inside big transactions.

A child process (`python -m tests.daemon.test_journal_crash ROOT LOG SEED`) behaves like the daemon's journal
thread, as fast as it can: it opens the journal, recovers, reconciles its sinks, then registers steps,
exports, publishes, fails, retries, quarantines, abandons and retires them through the journal's own API.
Now and then it adds or drops a sink, and `ensure_lanes` then rewrites every live step in one transaction.
Before each call it appends `{"b": n, "call": ..., "args": ...}` to LOG and fsyncs; after it, `{"e": n}`.

The test SIGKILLs it 25 times (seeded), in turn: at a random moment; a few milliseconds into a big
transaction; and the instant SQLite starts appending a big transaction to the WAL file (the WAL left behind
then holds frames after its last commit frame, which the test counts). After each kill, with the daemon's
own `Journal.open` and `recover()`:

- `PRAGMA integrity_check` is ok and no lane points at a missing step;
- the whole journal (every state, every step's and lane's event history, the meta) equals the model after
  every finished call, or after those and the one in flight: never anything between;
- every history chains from its first state to the current one through allowed moves only;
- `recover()` moves exactly the exporting steps to committed and the publishing lanes to pending.
"""

from __future__ import annotations

import copy
import json
import os
import random
import signal
import sqlite3
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from itertools import pairwise
from pathlib import Path
from typing import Any

from stagerd.daemon.journal import (
    COMMITTED,
    EXPORTED,
    EXPORTING,
    FAILED,
    PENDING,
    PUBLISHED,
    PUBLISHING,
    QUARANTINED,
    RETIRED,
    Journal,
    journal_path,
)

REPO = Path(__file__).resolve().parents[2]
SEED = 20240607
KILLS = 25
BASE_SINKS = ["file:///a", "s3://bucket/run"]
SETUP_STEPS = 300  # published steps that each sink change sends through one big transaction

Key = tuple[int, "str | None"]  # (step, None) is a step; (step, sink) is that step's lane on sink

STEP_MOVES = {
    (None, COMMITTED),
    (COMMITTED, EXPORTING),
    (FAILED, EXPORTING),
    (EXPORTING, EXPORTED),
    (EXPORTING, FAILED),
    (EXPORTING, COMMITTED),  # recovered after a crash, or abandoned at shutdown
    (EXPORTED, PUBLISHED),
    (PUBLISHED, EXPORTED),  # a new sink
    (EXPORTED, COMMITTED),  # export/ vanished: export again
    (PUBLISHED, COMMITTED),
    (PUBLISHED, RETIRED),
} | {(s, QUARANTINED) for s in (COMMITTED, EXPORTING, EXPORTED, PUBLISHED, FAILED)}
LANE_MOVES = {
    (None, PENDING),
    (PENDING, PUBLISHING),
    (FAILED, PUBLISHING),
    (PUBLISHING, PUBLISHED),
    (PUBLISHING, FAILED),
    (PUBLISHING, QUARANTINED),
    (PUBLISHING, PENDING),  # recovered after a crash, or abandoned at shutdown
    (PENDING, QUARANTINED),
    (FAILED, QUARANTINED),
}


# -- the model: what the journal must hold after a sequence of calls --------------------------------------


@dataclass
class Model:
    """The states, per-entity event histories and meta that a sequence of journal calls must leave."""

    states: dict[Key, str] = field(default_factory=dict)
    history: dict[Key, list[tuple[str | None, str]]] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)
    # (is a lane, state) -> keys: the child picks its next call from these many times a second
    index: dict[tuple[bool, str], set[Key]] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def of(cls, j: Journal) -> Model:
        """What the journal holds now, read through its public API."""
        m = cls(meta=j.meta())
        for r in j.steps():
            m._set((r.step, None), r.state)
        for ln in j.lanes():
            m._set((ln.step, ln.sink), ln.state)
        for e in j.events():
            m.history.setdefault((e.step, e.sink), []).append((e.from_state, e.to_state))
        return m

    def copy(self) -> Model:
        return Model(
            dict(self.states),
            {k: list(v) for k, v in self.history.items()},
            copy.deepcopy(self.meta),
            {k: set(v) for k, v in self.index.items()},
        )

    def where(self, state: str, *, lanes: bool = False) -> list[Key]:
        return sorted(self.index.get((lanes, state), ()))

    def _set(self, key: Key, state: str) -> None:
        lane = key[1] is not None
        old = self.states.get(key)
        if old is not None:
            self.index[(lane, old)].discard(key)
        self.index.setdefault((lane, state), set()).add(key)
        self.states[key] = state

    def apply(self, call: str, args: dict[str, Any]) -> None:
        """Do what journal method `call` does with `args`; AssertionError where the journal would refuse."""
        getattr(self, f"_{call}")(**args)

    def _move(self, key: Key, allowed: tuple[str, ...], to: str) -> None:
        old = self.states.get(key)
        assert old in allowed, f"the model refuses {key}: {old} -> {to}"
        self._set(key, to)
        self.history.setdefault(key, []).append((old, to))

    def _add_step(self, step: int) -> None:
        if (step, None) not in self.states:
            self._move((step, None), (None,), COMMITTED)

    def _begin_export(self, step: int) -> None:
        self._move((step, None), (COMMITTED, FAILED), EXPORTING)

    def _finish_export(self, step: int, sinks: list[str]) -> None:
        self._move((step, None), (EXPORTING,), EXPORTED)
        for sink in sinks:
            self._add_lane(step, sink)

    def _add_lane(self, step: int, sink: str) -> bool:
        if (step, sink) in self.states:
            return False
        self._move((step, sink), (None,), PENDING)
        return True

    def _fail_export(self, step: int, quarantine: bool) -> None:
        self._move((step, None), (EXPORTING,), QUARANTINED if quarantine else FAILED)

    def _quarantine_step(self, step: int) -> None:
        self._move((step, None), (COMMITTED, EXPORTING, EXPORTED, PUBLISHED, FAILED), QUARANTINED)

    def _begin_publish(self, step: int, sink: str) -> None:
        assert self.states[(step, None)] == EXPORTED
        self._move((step, sink), (PENDING, FAILED), PUBLISHING)

    def _finish_publish(self, step: int, sink: str, sinks: list[str]) -> None:
        self._move((step, sink), (PUBLISHING,), PUBLISHED)
        self._maybe_published(step, sinks)

    def _maybe_published(self, step: int, sinks: list[str]) -> None:
        if self.states[(step, None)] == EXPORTED and all(
            self.states.get((step, s)) == PUBLISHED for s in sinks
        ):
            self._move((step, None), (EXPORTED,), PUBLISHED)

    def _fail_publish(self, step: int, sink: str, quarantine: bool) -> None:
        self._move((step, sink), (PUBLISHING,), QUARANTINED if quarantine else FAILED)

    def _quarantine_lane(self, step: int, sink: str) -> None:
        self._move((step, sink), (PENDING, FAILED), QUARANTINED)

    def _reexport(self, step: int) -> None:
        self._move((step, None), (EXPORTED, PUBLISHED), COMMITTED)

    def _retire(self, step: int) -> None:
        self._move((step, None), (PUBLISHED,), RETIRED)

    def _recover(self) -> None:
        for key in self.where(EXPORTING):
            self._move(key, (EXPORTING,), COMMITTED)
        for key in self.where(PUBLISHING, lanes=True):
            self._move(key, (PUBLISHING,), PENDING)

    def _abandon(self, step: int, sink: str | None) -> None:
        self._move((step, sink), (EXPORTING, PUBLISHING), COMMITTED if sink is None else PENDING)

    def _ensure_lanes(self, sinks: list[str]) -> None:
        for step, _ in self.where(EXPORTED) + self.where(PUBLISHED):
            added = [s for s in sinks if self._add_lane(step, s)]
            if added and self.states[(step, None)] == PUBLISHED:
                self._move((step, None), (PUBLISHED,), EXPORTED)
        for step, _ in self.where(EXPORTED):
            self._maybe_published(step, sinks)

    def _set_meta(self, **values: Any) -> None:
        self.meta.update(values)


# -- the child: the daemon's journal calls, as fast as it can ----------------------------------------------


def call_journal(j: Journal, call: str, args: dict[str, Any]) -> None:
    """Make `call` on the real journal with the arguments the daemon would pass."""
    a = dict(args)
    if call == "finish_export":
        j.finish_export(
            a["step"], a["sinks"], seconds=0.1, export_bytes=10, tensor_bytes=8, files=1, skipped=False
        )
    elif call == "finish_publish":
        j.finish_publish(
            a["step"],
            a["sink"],
            sinks=a["sinks"],
            seconds=0.1,
            bytes_total=10,
            bytes_uploaded=10,
            location="x",
            skipped=False,
        )
    elif call in ("fail_export", "fail_publish"):
        q = a.pop("quarantine")
        getattr(j, call)(*a.values(), "SinkError", "injected", next_try=None if q else 0.0, quarantine=q)
    elif call in ("quarantine_step", "quarantine_lane"):
        getattr(j, call)(*a.values(), "CrashLoop", "injected")
    elif call in ("reexport", "retire"):
        getattr(j, call)(a["step"], "injected")
    elif call == "add_step":
        j.add_step(a["step"], f"/root/step-{a['step']:08d}", float(a["step"]))
    elif call == "abandon":
        j.abandon(a["step"], a["sink"], "abandoned at shutdown")
    elif call == "set_meta":
        j.set_meta(**a)
    else:
        getattr(j, call)(**a)


class Driver:
    """The child's loop: pick a valid call from its model of the journal, log it, make it, log its end."""

    def __init__(self, j: Journal, log_fd: int, rng: random.Random) -> None:
        self.j, self.fd, self.rng, self.n = j, log_fd, rng, 0
        self.model = Model.of(j)
        self.sinks: list[str] = list(self.model.meta.get("sinks", BASE_SINKS))
        self.next_step = max([k[0] for k in self.model.states] + [0]) + 1

    def do(self, call: str, why: str = "", **args: Any) -> None:
        self.n += 1
        self._log({"b": self.n, "call": call, "args": args, "why": why})
        call_journal(self.j, call, args)
        self.model.apply(call, args)
        self._log({"e": self.n})

    def _log(self, record: dict[str, Any]) -> None:
        os.write(self.fd, (json.dumps(record) + "\n").encode())
        os.fsync(self.fd)

    def start(self) -> None:
        """What the daemon does at start: recover, reconcile the sinks, record itself."""
        self.do("recover")
        self.do("ensure_lanes", sinks=self.sinks)
        self.do("set_meta", pid=os.getpid(), sinks=self.sinks)

    def step_once(self) -> None:
        choices = self._choices()
        _, act = self.rng.choices(choices, [w for w, _ in choices])[0]
        act()

    def _choices(self) -> list[tuple[float, Callable[[], None]]]:
        """(weight, call) for every call valid now, weighted roughly as a busy daemon makes them."""
        m, rng, do = self.model, self.rng, self.do
        out: list[tuple[float, Callable[[], None]]] = [(10, self._register), (20, self._begin_publish)]
        out.append((1, self._change_sinks))
        todo, exporting = m.where(COMMITTED) + m.where(FAILED), m.where(EXPORTING)
        if todo and not exporting:  # one export at a time, lowest step first
            out.append((15, partial(do, "begin_export", step=todo[0][0])))
        if todo:
            out.append((0.2, partial(do, "quarantine_step", step=rng.choice(todo)[0])))
        for step, _ in exporting:
            out.append((12, partial(do, "finish_export", step=step, sinks=self.sinks)))
            out.append((2, partial(do, "fail_export", step=step, quarantine=rng.random() < 0.1)))
            out.append((0.5, partial(do, "abandon", step=step, sink=None)))
        for step, sink in m.where(PUBLISHING, lanes=True):
            out.append((15, partial(do, "finish_publish", step=step, sink=sink, sinks=self.sinks)))
            out.append((2, partial(do, "fail_publish", step=step, sink=sink, quarantine=rng.random() < 0.1)))
            out.append((0.5, partial(do, "abandon", step=step, sink=sink)))
        published = m.where(PUBLISHED)
        if published:  # retention: the oldest published step goes first
            out.append((2, partial(do, "retire", step=published[0][0])))
        if done := m.where(EXPORTED) + published:
            out.append((0.3, partial(do, "reexport", step=rng.choice(done)[0])))
        if waiting := m.where(PENDING, lanes=True) + m.where(FAILED, lanes=True):
            step, sink = waiting[0]
            out.append((0.2, partial(do, "quarantine_lane", step=step, sink=sink)))
        return out

    def _register(self) -> None:
        for _ in range(self.rng.randint(1, 4)):  # a scan finds a few steps, one transaction each
            self.do("add_step", step=self.next_step)
            self.next_step += 1

    def _begin_publish(self) -> None:
        sink = self.rng.choice(self.sinks)
        if any(k[1] == sink for k in self.model.where(PUBLISHING, lanes=True)):
            return  # one publish at a time per sink, like one publish worker per lane
        for step, _ in self.model.where(EXPORTED):
            if self.model.states.get((step, sink)) in (PENDING, FAILED):
                self.do("begin_publish", step=step, sink=sink)
                return

    def _change_sinks(self) -> None:
        """A restart with one sink more or fewer: `ensure_lanes` rewrites every live step at once."""
        extra = [s for s in self.sinks if s not in BASE_SINKS]
        self.sinks = BASE_SINKS + ([] if extra else [f"hf://org/run-{self.rng.getrandbits(32):08x}"])
        self.do("ensure_lanes", why="big", sinks=self.sinks)
        self.do("set_meta", sinks=self.sinks)


def child_main(root: str, log: str, seed: int) -> None:
    """The child process: start like the daemon, then make journal calls until killed."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    d = Driver(Journal.open(root), fd, random.Random(seed))
    d.start()
    while True:
        d.step_once()


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
            [sys.executable, "-m", "tests.daemon.test_journal_crash", str(root), str(log), str(seed)],
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO)},
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
    assert set(m.history) == set(m.states)
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
    for i in range(KILLS):
        kind = ("random", "big", "wal")[i % 3]
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
    print(
        f"{KILLS} kills after {calls_made} calls in {time.monotonic() - t0:.1f}s: {outcome}; "
        f"{inside_big} inside a big transaction, {torn_commits} with its WAL write cut short"
    )
    # The kills did land inside big transactions, and inside SQLite's own writes, not only between calls.
    assert inside_big >= 4 and torn_commits >= 2
    # and the work went on between the kills: steps the children found were published
    assert any(k[0] > SETUP_STEPS and (EXPORTED, PUBLISHED) in h for k, h in model.history.items())


if __name__ == "__main__":
    child_main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
