"""The child of the journal SIGKILL test (test_crash.py): the daemon's journal calls, as fast as it
can, and the model of what the journal must hold after them.

Run as `python -m tests.daemon.journal.crash_child ROOT LOG SEED`: it opens the journal, recovers,
reconciles its sinks, then registers steps, exports, publishes, fails, retries, quarantines, abandons and
retires them through the journal's own API. Now and then it adds or drops a sink, and `ensure_lanes` then
rewrites every live step in one transaction. Before each call it appends `{"b": n, "call": ..., "args": ...}`
to LOG and fsyncs; after it, `{"e": n}`.
"""

from __future__ import annotations

import copy
import json
import os
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
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
)
from stagerd.daemon.journal.schema import RETIRED_WITH_HISTORY

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
        retired = self.where(RETIRED)
        if len(retired) <= RETIRED_WITH_HISTORY:
            return
        # the journal keeps the events and lanes of the newest RETIRED_WITH_HISTORY retired steps only
        cut = retired[-RETIRED_WITH_HISTORY - 1][0]
        gone = {s for s, _ in retired if s <= cut}
        for key in [k for k in self.history if k[0] in gone]:
            del self.history[key]
        for key in [k for k in self.states if k[1] is not None and k[0] in gone]:
            self.index[(True, self.states.pop(key))].discard(key)

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


if __name__ == "__main__":
    child_main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
