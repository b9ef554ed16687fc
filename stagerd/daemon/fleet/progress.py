"""What each node of a fleet step reports of its own work while the others wait for it: the writer
(`Progress`, `fleet/step-N/progress/node-K.json`) and the reader the waits show it through (`Reports`). A
report is only ever shown: it says a node is busy, never that anything it made is there."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Iterable

from stagerd.contract.json_fields import loads
from stagerd.errors import StagerdError
from stagerd.ops.crashpoints import crash_point
from stagerd.sinks.fetch import RemoteStore
from stagerd.sinks.fsspec import FsspecSink

PROGRESS_DIR = "progress"
MAX_PROGRESS_BYTES = 4096

log = logging.getLogger("stagerd.fleet")


def progress_key(base: str, node: int) -> str:
    """Node `node`'s report under the step's folder `base` on the exchange."""
    return f"{base}/{PROGRESS_DIR}/node-{node:05d}.json"


class Reports:
    """The other nodes' reports of step folder `base`, as one node's waits read them (`of`)."""

    def __init__(self, store: RemoteStore, base: str) -> None:
        self.store, self.base = store, base
        self._listed: dict[int, object] = {}  # node -> its report's listing when last read
        self._best: dict[tuple[int, str], int] = {}  # (node, what it does) -> the most bytes seen done
        self._shown: dict[int, str] = {}  # node -> its furthest report: "building NAME: 4096 bytes"

    def of(self, nodes: Iterable[int]) -> str:
        """What `nodes` last reported of their work (`Progress`), for a wait's text ("; node 1 sending its
        raw part: 4096 bytes"); "" when none did. One listing a poll, and a read only of a report that
        changed.

        A report counts (and is shown) only when the node's work advanced: more bytes of a work than it was
        ever seen to have done, or a work not seen before. A node in a crash loop sends its part again on
        every restart, reporting the same bytes again: the text then keeps its furthest report, so the
        wait (which starts again only when its text changes) still ends after the setting."""
        listed = self.store.objects(f"{self.base}/{PROGRESS_DIR}")
        out = []
        for k in nodes:
            o = listed.get(f"node-{k:05d}.json")
            if o is None:
                continue
            tag = (o.tag, o.size, o.mtime)
            if self._listed.get(k) != tag:
                self._listed[k] = tag
                self._advanced(k, self._report(k))
            if self._shown.get(k):
                out.append(f"; node {k} {self._shown[k]}")
        return "".join(out)

    def _advanced(self, node: int, report: tuple[str, int] | None) -> None:
        if report is None or report[1] <= self._best.get((node, report[0]), -1):
            return  # nothing, or what the node was already seen to have done (a restart doing it again)
        self._best[(node, report[0])] = report[1]
        self._shown[node] = f"{report[0]}: {report[1]} bytes"

    def _report(self, node: int) -> tuple[str, int] | None:
        try:
            d = loads(self.store.read(progress_key(self.base, node), limit=MAX_PROGRESS_BYTES) or b"null")
        except (StagerdError, ValueError):
            return None  # gone since the listing, or not a report: nothing to show
        if not isinstance(d, dict) or not isinstance(d.get("doing"), str) or type(d.get("bytes")) is not int:
            return None
        return "".join(c if c.isprintable() else "?" for c in d["doing"][:200]), d["bytes"]


class Progress:
    """What this node is doing, and how many bytes of it are done, for the waits of the other nodes
    (`Reports`): a raw upload or a build longer than the fleet wait is no node that never comes. Written to
    `key` on `exchange` whenever it changed, at most every `every` seconds (`StepExchange.reporting`: a
    quarter of the wait, 10 s at most), by a thread of its own: an upload's progress may be reported on the
    store's event loop, where a write to the same store would wait for itself. A node that only waits
    reports nothing new, so two waiting nodes never keep each other's waits alive."""

    def __init__(self, exchange: FsspecSink, key: str, step: int, every: float) -> None:
        self.exchange, self.key, self.step, self.every = exchange, key, step, every
        self.now: tuple[str, int] = ("", 0)  # replaced whole: the writer reads it from its own thread
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"fleet-progress-{step}", daemon=True)
        self._warned = False

    def __enter__(self) -> Progress:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop reporting; once this returns no report is written (nor in flight)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def doing(self, what: str, crash: str | None = None) -> Callable[[int, int], None]:
        """A progress callback (`done`, `total` bytes) for the work `what` ("building NAME")."""

        def report(done: int, total: int) -> None:
            if crash is not None:
                crash_point(crash)
            self.now = (what, done)

        return report

    def _run(self) -> None:
        written = self.now
        while not self._stop.wait(self.every):
            now = self.now
            if now == written:
                continue
            try:
                data = json.dumps({"doing": now[0], "bytes": now[1]}).encode()
                self.exchange.backend.write(self.key, data)
                written = now
            except Exception as e:  # a report of progress must never fail the step
                if not self._warned:
                    self._warned = True
                    log.warning(
                        "step %d: could not report this node's progress on the exchange: %s",
                        self.step,
                        e,
                        extra={"step": self.step},
                    )
