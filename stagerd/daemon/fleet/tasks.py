"""The daemon's side of a fleet export (issue 14): a node-locally staged step (its marker says
`staging_nodes` > 1) is built by every node's daemon together through the exchange (`daemon/fleet/node.py`)
instead of by `export_step`, which would refuse it. The step's export task runs this node's part of the
protocol; its publish lane only confirms the sink holds the step the fleet committed.

The fleet publishes to every fsspec sink (each owner uploads its files to each, the leader commits each
as soon as its files are there); a sink that fails in the export is left to its own publish lane, which
fails first with that error and then runs the fleet for that sink alone until it commits (`_fleet_lane`);
the first is also the exchange (its `raw/` and `fleet/` prefixes) unless `exchange` names another fsspec
URL. With only Hub sinks it builds on the exchange (`daemon/fleet/hub.py` then publishes it to the Hub).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stagerd.contract import commit_marker, layout
from stagerd.contract.root_id import root_id
from stagerd.daemon.journal import COMMITTED, PENDING
from stagerd.daemon.state import DaemonState, log
from stagerd.errors import ConfigError, FleetWaitError, MarkerError, SinkError
from stagerd.sinks.base import PublishResult
from stagerd.sinks.fs_open import opening_again
from stagerd.sinks.fsspec import FsspecSink

if TYPE_CHECKING:
    from stagerd.daemon.fleet.node import FleetNode
    from stagerd.daemon.yielding import Yielder
    from stagerd.engine.export import ExportResult
    from stagerd.sinks.fetch import RemoteStore


# One lock for every daemon of the process (there is one, but for tests): the waits change rarely.
_WAITS_LOCK = threading.Lock()


def wait_key(step: int, sink: str | None) -> str:
    """A wait's key in /healthz's `fleet`: "7" for the export's, "7 on hf://org/a" for a Hub lane's."""
    return str(step) if sink is None else f"{step} on {sink}"


def is_fleet_step(step_dir: Path) -> bool:
    """Staged node-locally on several nodes (False for a whole step, or one whose marker cannot be read:
    the export names that)."""
    try:
        return commit_marker.read_marker(step_dir).staging_nodes > 1
    except (MarkerError, OSError):
        return False


class FleetTasks(DaemonState):
    _fleet_staging: tuple[str, FsspecSink] | None = None

    def _fleet_sink(self) -> tuple[str, FsspecSink]:
        """The first sink the fleet builds its export on (the default exchange, what a Hub lane reads)."""
        return self._fleet_sinks()[0]

    def _fleet_sinks(self) -> list[tuple[str, FsspecSink]]:
        """Where the fleet builds its export: every fsspec sink, else (Hub sinks only) `EXCHANGE/export`."""
        mine = [(url, sink) for url, sink in self._sinks.items() if isinstance(sink, FsspecSink)]
        if mine:
            return mine
        if self.settings.exchange is not None:
            if self._fleet_staging is None:
                from stagerd.daemon.fleet.exchange_places import EXPORT_PREFIX

                url = f"{self.settings.exchange.rstrip('/')}/{EXPORT_PREFIX}"
                self._fleet_staging = (url, FsspecSink.from_url(url))
            return [self._fleet_staging]
        raise ConfigError(
            "a node-locally staged step needs an fsspec sink (S3, GCS, a shared mount) or --exchange URL",
            hint="add --sink s3://BUCKET/PREFIX, or --exchange URL beside a Hub sink, to every node's daemon",
        )

    def _fleet_root_id(self) -> str:
        """This ROOT's identity on the exchange (`contract/root_id.py`): two ROOTs claiming one node id, a
        copy of a ROOT among them, are told apart."""
        return root_id(self.root)

    def _fleet_exchange(self) -> tuple[FsspecSink, RemoteStore]:
        """The exchange as a sink (raw parts, records) and as a store (ranged reads); close both after."""
        from stagerd.sinks.fetch import RemoteStore

        url, _ = self._fleet_sink()
        ex = self.settings.exchange
        with opening_again(ex or url):
            exchange = FsspecSink.from_url(ex or url)
            try:
                return exchange, RemoteStore.open(ex or url)
            except BaseException:
                exchange.close()
                raise

    def _run_fleet(self, step: int, step_dir: Path, pause: Yielder | None = None) -> ExportResult:
        """Worker thread: this node's part of the fleet export of `step`, until the step is committed on
        every fsspec sink but those that failed on the way: each of those its own lane (`_fleet_lane`).
        `pause`: the export's yield to a save on this node, between the moves of the files it builds."""
        exchange, store = self._fleet_exchange()
        still_waiting = False
        self._fleet_budget(pause)
        try:
            work = self.root / ".stagerd" / "fleet" / step_dir.name
            node = self._fleet_node(step_dir, work, exchange, store, self._fleet_status(step), pause=pause)
            res = node.run()
            urls = {sink.url: url for url, sink in self._fleet_sinks()}
            for url, err in res.failed.items():  # that sink's lane: its first try says why, then retries
                self._fleet_failed()[(step, urls.get(url, url))] = err
        except FleetWaitError:
            still_waiting = True  # the step keeps waiting (retried, never quarantined): keep reporting it
            raise
        finally:
            store.close()
            exchange.close()
            if not still_waiting:
                self._fleet_wait_over(step, journal=True)
        log.info(
            "step %d: fleet node %d of %d built %d file(s), fetched %d bytes, uploaded %d bytes",
            step,
            res.node,
            res.nodes,
            len(res.built),
            res.bytes_fetched,
            res.bytes_uploaded,
            extra={"step": step, "fleet_node": res.node, "bytes_fetched": res.bytes_fetched},
        )
        from stagerd.engine.export import ExportResult

        # the whole export, as the sinks show it (status, the log), not this node's share: the line above
        # says that
        files = tuple(res.files)
        return ExportResult(
            step_dir / layout.EXPORT_DIR,
            files,
            res.tensor_bytes,
            res.tensors,
            res.seconds,
            False,
            res.own_bytes,
        )

    def _fleet_budget(self, pause: Yielder | None) -> None:
        """The other nodes wait on this one's files. The trainer saves on every node at once, so each node's
        fleet work pauses for its own node's save (between the moves of its builds and its mirror's range
        fetches, the downloads of a Hub lane), and the training (whose ranks meet again after it) is what
        gains. The raw part and the uploads are the network's: never paused. Half the fleet wait at most,
        so a pause alone never ends another node's wait (`FleetWaitError`)."""
        if pause is not None:
            pause.budget = min(pause.budget, self.settings.fleet_wait_seconds / 2)

    def _fleet_node(
        self,
        step_dir: Path,
        work: Path,
        exchange: FsspecSink,
        store: RemoteStore,
        status: Callable[[str, int], None],
        lanes: list[FsspecSink] | None = None,
        pause: Callable[[], None] | None = None,
    ) -> FleetNode:
        """This node's FleetNode for `step_dir`: every fsspec sink, or the sinks `lanes` alone."""
        from stagerd.daemon.fleet.node import FleetNode, FleetOptions

        s, sinks = self.settings, [sink for _, sink in self._fleet_sinks()]
        hubs = tuple(u for u, sink in self._sinks.items() if not isinstance(sink, FsspecSink))
        options = FleetOptions(
            dtype=s.dtype,
            keep_dtype=s.keep_dtype,
            mapping=s.mapping,
            max_shard_size=s.shard_size(fleet=True),
            wait_seconds=s.fleet_wait_seconds,
            threads=s.export_threads,
            hub=bool(hubs),
            hubs=hubs,
            stopping=lambda: self._stopping,
            pause=pause,
        )
        root = self._fleet_root_id()
        return FleetNode(step_dir, work, sinks, exchange, store, root, options, status, lanes)

    async def _fleet_stopped(self, step: int, sink: str | None) -> None:
        """A fleet wait ended by the shutdown (`exchange.Stopped`): abandoned, as the drain abandons work
        still running at its end (the attempt given back), without holding the shutdown for its grace."""
        await self._j(self._journal.abandon, step, sink, "abandoned at shutdown")
        self._log_step(step, sink, COMMITTED if sink is None else PENDING, note="abandoned at shutdown")

    def _fleet_failed(self) -> dict[tuple[int, str], BaseException]:
        """(step, sink URL) -> what stopped that sink in the step's fleet export, for its lane's first try."""
        failed: dict[tuple[int, str], BaseException] = vars(self).setdefault("_fleet_sink_failed", {})
        return failed

    def _fleet_lane(self, step: int, sink_url: str, target: FsspecSink, pause: Yielder | None = None) -> None:
        """Lane worker: this node's part of the fleet export of `step` for one fsspec sink that failed in
        it (`FleetNode`'s `lanes`), retried as any publish: the other sinks' commits stand. `pause`: as
        the export's, its budget the lane's over its retries."""
        err = self._fleet_failed().pop((step, sink_url), None)
        if err is not None:
            raise err
        from stagerd.daemon.fleet.records import sink_id

        step_dir = self.root / layout.step_dir_name(step)
        work = self.root / ".stagerd" / "fleet" / f"{step_dir.name}.{sink_id(sink_url)}"
        exchange, store = self._fleet_exchange()
        with self._lane_waiting(step, sink_url, store, exchange):
            status = self._fleet_status(step, sink_url)
            self._fleet_node(step_dir, work, exchange, store, status, [target], pause=pause).run()

    @contextlib.contextmanager
    def _lane_waiting(self, step: int, sink_url: str, *closing: Any) -> Iterator[None]:
        """A lane's fleet work: `closing` closed after it, and its wait entry cleared unless it still
        waits (`FleetWaitError`, as the export task's wait: the step keeps waiting, and says so)."""
        still_waiting = False
        try:
            yield
        except FleetWaitError:
            still_waiting = True
            raise
        finally:
            for c in closing:
                c.close()
            if not still_waiting:
                self._fleet_wait_over(step, sink_url, journal=True)

    def _fleet_status(self, step: int, sink: str | None = None) -> Callable[[str, int], None]:
        """Where a fleet wait of `step` reports (`StepExchange.wait`): /healthz, the metrics, the journal.
        `sink`: a Hub lane's wait for that sink, kept apart from the export's and from every other sink's
        (`wait_key`), so that one lane's wait ending never clears another's."""
        said = [""]

        def status(text: str, missing: int) -> None:
            if not text:
                self._fleet_wait_over(step, sink)
            else:
                with _WAITS_LOCK:  # lanes of one step report from their own threads
                    self._fleet_missing()[(step, sink)] = missing
                    self._fleet_waits_changed(step, {wait_key(step, sink): text})
            if text != said[0]:  # a journal commit per change, not per poll
                said[0] = text
                self._note_wait(step, sink, text)

        return status

    def _fleet_waits_changed(self, step: int, health: dict[str, str], gone: str | None = None) -> None:
        """Under `_WAITS_LOCK`: /healthz's `fleet` entries (replaced whole, never mutated: /healthz serializes
        it from the event loop's thread) and the step's gauge, the most nodes any of its waits awaits."""
        left = {k: v for k, v in self._health.get("fleet", {}).items() if k != gone}
        left.update(health)
        if left:
            self._health["fleet"] = left
        else:
            self._health.pop("fleet", None)
        most = max((n for (s, _), n in self._fleet_missing().items() if s == step), default=0)
        self.metrics.fleet_waiting.labels(step=str(step)).set(most)

    def _fleet_missing(self) -> dict[tuple[int, str | None], int]:
        """Under `_WAITS_LOCK`: (step, sink) -> the nodes that wait awaits now."""
        missing: dict[tuple[int, str | None], int] = vars(self).setdefault("_fleet_waiting", {})
        return missing

    def _note_wait(self, step: int, sink: str | None, text: str) -> None:
        """Worker thread: record the wait in the journal (for `stagerd status`), on the journal's thread;
        a failed write is only logged (the wait goes on, and /healthz still shows it)."""

        def done(f: Future[None]) -> None:
            if f.exception() is not None:
                log.warning("step %d: could not record the fleet wait: %s", step, f.exception())

        try:
            self._jpool.submit(self._journal.set_wait, step, text or None, sink).add_done_callback(done)
        except RuntimeError:  # the journal's pool is shut down: a worker abandoned at shutdown, still running
            log.debug("step %d: fleet wait not recorded, the daemon has stopped", step)

    def _fleet_wait_over(self, step: int, sink: str | None = None, *, journal: bool = False) -> None:
        if journal:
            self._note_wait(step, sink, "")
        with _WAITS_LOCK:
            self._fleet_missing().pop((step, sink), None)
            self._fleet_waits_changed(step, {}, gone=wait_key(step, sink))

    def _fleet_publish(self, step: int, sink_url: str, pause: Yielder | None = None) -> PublishResult:
        """Lane worker: the fleet committed the step on this fsspec sink (else this sink failed in it, and
        its lane runs the fleet for it: `_fleet_lane`), or (a Hub sink) node 0 publishes the step the fleet
        committed on the first fsspec sink that holds it. `pause`: the lane's yield, for the work it does
        on this node's disk (its fleet run's builds, a Hub lane's download), never for its uploads."""
        t0 = time.monotonic()
        self._fleet_budget(pause)
        url, sink = self._fleet_sink()
        from stagerd.sinks.hub.sink import HubSink

        target = self._sinks[sink_url]
        if sink_url != url and isinstance(target, HubSink):
            from stagerd.daemon.fleet.hub import publish_to_hub
            from stagerd.daemon.fleet.lanes import published
            from stagerd.daemon.fleet.records import sink_id

            # from a sink that holds the step: a failed one's lane may still be at work
            url, sink = next(((u, s) for u, s in self._fleet_sinks() if published(s, step)), (url, sink))
            exchange, store = self._fleet_exchange()
            with self._lane_waiting(step, sink_url, store, exchange):
                step_dir = self.root / layout.step_dir_name(step)
                # each Hub sink its own download: two lanes of one step run at once
                work = (
                    self.root / ".stagerd" / "fleet-hub" / f"{layout.step_dir_name(step)}.{sink_id(sink_url)}"
                )
                return publish_to_hub(
                    step,
                    step_dir,
                    work,
                    target,
                    sink,
                    exchange,
                    url,
                    exchange_store=store,
                    wait_seconds=self.settings.fleet_wait_seconds,
                    status=self._fleet_status(step, sink_url),
                    hubs=[u for u, s in self._sinks.items() if isinstance(s, HubSink)],
                    sinks=[s for _, s in self._fleet_sinks()],
                    stopping=lambda: self._stopping,
                    pause=pause,
                )
        if not isinstance(target, FsspecSink):
            raise SinkError(
                f"step {step} was staged node-locally: the fleet cannot serve this sink", path=sink_url
            )
        if not target.is_published(step):
            self._fleet_lane(step, sink_url, target, pause)
        return PublishResult(
            sink=sink_url,
            step=step,
            location=f"{sink_url}/{layout.step_dir_name(step)}",
            files=0,
            bytes_total=0,
            bytes_uploaded=0,
            skipped=True,
            seconds=time.monotonic() - t0,
        )
