"""One fleet step on the exchange, as one node sees it: the keys of its claims and file records, their
conditional creates and reads, the byte ranges of other nodes' parts, the files sent to a sink's
`step-N/`, and the waits for other nodes (`wait`)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from stagerd.contract import layout
from stagerd.daemon.fleet.records import sink_id
from stagerd.errors import FleetWaitError
from stagerd.sinks.fetch import RemoteStore
from stagerd.sinks.fsspec import FsspecSink
from stagerd.sinks.objects import ByteProgress, LocalFile, Uploaded

FLEET_DIR = "fleet"


class StepExchange:
    """Node `me` of `nodes`' view of step `step` on `exchange` (read through `store`)."""

    def __init__(
        self,
        exchange: FsspecSink,
        store: RemoteStore,
        step: int,
        me: int,
        nodes: int,
        wait_seconds: float,
        poll_seconds: float,
        status: Callable[[str, int], None],
    ) -> None:
        self.exchange, self.store = exchange, store
        self.step, self.me, self.nodes = step, me, nodes
        self.wait_seconds, self.poll_seconds, self.status = wait_seconds, poll_seconds, status
        self.base = f"{FLEET_DIR}/{layout.step_dir_name(step)}"
        self.waited = 0.0  # seconds asleep in `wait`

    def claim_key(self, node: int) -> str:
        return f"{self.base}/node-{node:05d}.json"

    def record_key(self, sink: FsspecSink, name: str) -> str:
        """One record per sink and file: the store checksum it holds is that sink's."""
        return f"{self.base}/done/{sink_id(sink.url)}/{name}.json"

    def record_data(self, sink: FsspecSink, name: str) -> dict[str, Any] | None:
        data = self.exchange.backend.read(self.record_key(sink, name))
        return None if data is None else dict(json.loads(data))

    def create(self, key: str, data: bytes) -> bool:
        return self.exchange.backend.create(key, data)

    def read(self, key: str, start: int, end: int) -> bytes:
        data: bytes = self.store.fs.cat_file(self.store.path(key), start=start, end=end)
        return data

    def upload(self, sink: FsspecSink, files: list[LocalFile]) -> list[Uploaded]:
        prefix = layout.step_dir_name(self.step)
        return sink.backend.upload(prefix, files, ByteProgress(sum(f.size for f in files), None))

    def wait(self, done: Callable[[], bool], what: Callable[[], str]) -> None:
        """Poll `done` until it holds; `what` says what is awaited ("waiting for node 1, 2 (seen: ...)"),
        reported as soon as it is found missing and cleared (`status("", 0)`) once the wait is over. It
        fails once `wait_seconds` pass with `what` unchanged: a new part, record or claim is progress."""
        if done():
            return
        # each wait its own: the raw upload and the builds before it may take longer than the setting;
        # and each change its own: 8 owners' records arriving a minute apart are no node that never comes
        last, deadline = None, 0.0
        while not done():
            text = what()
            if text != last:
                last, deadline = text, time.monotonic() + self.wait_seconds
            named = text.split(" (", 1)[0].rsplit("node ", 1)[-1]
            self.status(text, len([n for n in named.split(", ") if n.isdigit()]) or 1)
            if time.monotonic() >= deadline:
                raise FleetWaitError(
                    f"step {self.step}, node {self.me}: {text}: nothing new for {self.wait_seconds:g} s",
                    path=self.exchange.url,
                )
            time.sleep(self.poll_seconds)
            self.waited += self.poll_seconds
        self.status("", 0)
