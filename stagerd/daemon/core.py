"""`stagerd watch`: the per-node asyncio daemon.

It finds committed steps (watchfiles events plus a periodic rescan), exports them in step order in a
worker pool, publishes each exported step on every sink in that sink's own lane (its own threads and
concurrency, so a slow store never holds up another), and applies retention. The journal records every
transition before and after the work, so a restart after any crash resumes; the export engine and the
sinks are idempotent, so resumed work neither loses nor duplicates a step.

Blocking work (exports, uploads, journal commits with fsync, scans, deletes) runs in thread pools; the
event loop only schedules. This file is the life cycle (start, run, signals, drain); each job the loop
runs lives in its own module: gate (journal calls and backoff), discovery, scheduling, tasks (export and
publish), housekeeping, health, policy (retries) and summary (`--once`).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import signal
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, cast

from stagerd.config import Settings
from stagerd.contract import layout
from stagerd.daemon.housekeeping import Housekeeping
from stagerd.daemon.journal import COMMITTED, PENDING, Journal
from stagerd.daemon.journal.raw import raw_lane
from stagerd.daemon.lock import RootLock
from stagerd.daemon.metrics import Metrics, MetricsServer
from stagerd.daemon.policy import Failure, backoff_delay, decide_failure, once_sink_options
from stagerd.daemon.retention import empty_trash
from stagerd.daemon.root_places import adopt_root, check_adopt_places, check_root_places, claim_export_dir
from stagerd.daemon.scheduling import Scheduling
from stagerd.daemon.state import log
from stagerd.daemon.summary import OnceSummary, Summary
from stagerd.daemon.yielding import YieldLedger
from stagerd.errors import ConfigError, JournalError
from stagerd.ops import notify
from stagerd.ops.priority import lower_priority
from stagerd.sinks import open_sink
from stagerd.sinks.objects import redact_url
from stagerd.sinks.places import place_of
from stagerd.sinks.urls import SinkKind, parse_sink_url

if TYPE_CHECKING:
    from collections.abc import Callable

    from stagerd.sinks.fsspec import FsspecSink

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)

__all__ = ["Daemon", "Failure", "Summary", "backoff_delay", "decide_failure"]


def _warm_engine() -> None:
    """Import the export engine (numpy, safetensors) before the first step, not inside its pickup."""
    import stagerd.engine.export  # noqa: F401


class Daemon(Scheduling, Housekeeping, OnceSummary):
    """One ROOT's daemon. `await run()` returns the process exit code."""

    def __init__(self, settings: Settings, on_start: Callable[[list[str]], None] | None = None) -> None:
        """`on_start(lanes)` runs once ROOT is locked and the sinks are open, before any step is touched:
        `lanes` are the lanes a step must finish to be published now (what `watch` warns of at its start)."""
        if settings.root is None:
            raise ConfigError("no ROOT given: `stagerd watch ROOT --sink URL`")
        if not settings.sinks:
            raise ConfigError("no sink: pass --sink URL (or STAGERD_SINKS, or `sinks` in the config file)")
        self.settings = settings
        self._on_start = on_start
        self.root = Path(settings.root)
        self.metrics = Metrics()
        self.left_threads_running = False  # set when shutdown abandoned work still running in a thread
        self.metrics_address: tuple[str, int] | None = None
        self._sinks = {}
        self._raw_sinks = {}
        self._prune_stores = {}
        self._lane_pools = {}
        self.summary: Summary | None = None
        self._background = set()
        self._stopping = False
        self._inflight_exports = {}
        self._inflight_publishes = {}
        self._marker_metadata = {}
        self._odd_names = set()
        self._unfinished = []
        self._nested = []
        self._unfinished_recorded = None
        self._started = time.time()
        self._saves = self._saves_in_flight()
        self._yield_ledger = YieldLedger()
        self._outages = {}
        self._retention_kept = set()
        self._retention_pinned = set()
        self._adopt_clashes = set()
        self._adopt_presets = {}
        self._adopt_root = None if settings.adopt is None else adopt_root(self.root, settings.export_dir)
        self._beat = time.monotonic()
        self._disk = None
        self._health = {"status": "starting", "pid": os.getpid()}
        self._journal_failures = 0  # consecutive failed journal calls; 0 once a write lands again
        self._journal_retry_at = 0.0  # monotonic; nothing touches the journal before this
        self._fatal = None  # --once: the journal error that ends the run (exit 3)

    async def run(self) -> int:
        """Lock ROOT, recover, scan, then run until a signal (or, with `once`, until everything settles)."""
        if not self.root.exists():  # a daemon started before its trainer made the folder, or a typo
            meant = layout.closest_existing(self.root)
            raise ConfigError(
                "ROOT does not exist",
                path=self.root,
                hint=(f"did you mean {meant}? Else " if meant else "")
                + f"create it (`mkdir -p {self.root}`) and start the daemon again: it then waits for the "
                "trainer's steps",
            )
        if not self.root.is_dir():
            raise ConfigError("ROOT is not a directory", path=self.root)
        check_root_places(self.root, self.settings.sinks, self.settings.exchange)
        if self._adopt_root is not None:
            check_adopt_places(self.root, self._adopt_root, self.settings)
        lock = self._root_lock = RootLock(self.root)
        lock.acquire()
        try:
            self._root_stat = os.stat(self.root)  # a checkpoint is lost only while ROOT is still this one
            if self._adopt_root is not None and self.settings.export_dir is not None:
                claim_export_dir(self.root, self._adopt_root, self._fleet_root_id())
            # Niceness and the I/O class are per thread on Linux: set them before any thread exists.
            applied = lower_priority(self.settings.nice, self.settings.io_class)
            self._jpool = ThreadPoolExecutor(1, thread_name_prefix="stagerd-journal")
            self._iopool = ThreadPoolExecutor(1, thread_name_prefix="stagerd-io")
            # Deleting a retired step can take seconds: its own thread, so scans and checks never wait on it.
            self._trashpool = ThreadPoolExecutor(1, thread_name_prefix="stagerd-trash")
            self._export_pool = ThreadPoolExecutor(
                self.settings.export_workers, thread_name_prefix="stagerd-export"
            )
            try:
                return await self._run(applied)
            finally:
                for pool in (self._export_pool, self._iopool, self._trashpool, *self._lane_pools.values()):
                    pool.shutdown(wait=not self.left_threads_running, cancel_futures=True)
                self._jpool.shutdown(wait=True)
        finally:
            lock.release()

    async def _run(self, applied: dict[str, object]) -> int:
        loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        self._stop = asyncio.Event()
        self._housekeep = asyncio.Event()
        # First: a signal during start-up (a slow scan, a slow sink) stops it cleanly instead of killing it.
        # SIGHUP (a closed SSH session or terminal) stops the daemon like SIGTERM: there is no reload.
        for sig in STOP_SIGNALS:
            loop.add_signal_handler(sig, self._on_signal, sig)
        server = None
        try:
            # Before anything is written or recovered: a port in use fails a second daemon with nothing done.
            server = self._serve_metrics()
            self._journal = await self._io(Journal.open, self.root)
            for url in self.settings.sinks:
                options = once_sink_options(url) if self.settings.once else {}
                sink = await self._io(open_sink, url, **options)
                self._sinks[sink.url] = sink
                self._lane_pools[sink.url] = ThreadPoolExecutor(
                    self.settings.publish_workers, thread_name_prefix="stagerd-publish"
                )
            if self.settings.publish_raw:
                self._open_raw_lanes()
            if self._on_start is not None:
                await self._io(self._on_start, self._lane_keys())
            await self._io(self._open_prune_stores)
            log.info(
                "stagerd watching %s",
                self.root,
                extra={"root": str(self.root), "sinks": list(self._sinks), "pid": os.getpid(), **applied},
            )
            await loop.run_in_executor(self._export_pool, _warm_engine)
            removed = await self._trash(empty_trash, self.root, *self._set_aside_places())
            if removed:
                log.info("removed %d leftover(s) of an interrupted retention from the trash", removed)
            await self._recover()
            for url in list(self._prune_stores):  # finish a prune a killed daemon left half done
                await self._after_publish(url)
            await self._scan()
            await self._j(
                self._journal.set_meta,
                pid=os.getpid(),
                started=time.time(),
                sinks=list(self._sinks),
                lanes=self._lane_keys(),  # what a later start compares its own with (a sink added since)
                low_disk_free_percent=self.settings.low_disk_free_percent,
                low_disk_free_bytes=self.settings.low_disk_free_bytes,
                keep_last=self.settings.keep_last,
            )
            await self._check_disk()
            await self._refresh()
            notify.notify_ready(f"watching {self.root}")
            if not self._stopping:
                self._health["status"] = "ok"
            tasks = [
                asyncio.create_task(self._ticker(), name="ticker"),
                asyncio.create_task(self._housekeeping(), name="housekeeping"),
            ]
            if not self.settings.once:
                tasks.append(asyncio.create_task(self._rescanner(), name="rescan"))
                if self.settings.watch:
                    tasks.append(asyncio.create_task(self._watcher(), name="watch"))
            try:
                await self._schedule()
            finally:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
            await self._drain()
            if self._fatal is not None:
                raise self._fatal
            if self.settings.once and not self._stopping:
                await self._retain()
                self.summary = await self._summary()
                return self._report(self.summary)
            log.info("stagerd stopped", extra={"state": "stopped"})
            return 0
        finally:
            for sig in STOP_SIGNALS:
                loop.remove_signal_handler(sig)
            if server is not None:
                server.close()
            closers = [s.close for s in self._sinks.values()] + [
                s.close for s, *_ in self._prune_stores.values()
            ]
            for close in closers:
                with contextlib.suppress(Exception):
                    await self._io(close)
            if hasattr(self, "_journal"):
                await self._j(self._journal.close)

    def _open_raw_lanes(self) -> None:
        """--publish-raw: one raw lane, with its own threads, per fsspec sink (the Hub: the export only)."""
        for url, sink in self._sinks.items():
            if hasattr(sink, "publish_raw"):  # FsspecSink; the Hub gets the HF export only
                key = raw_lane(url)
                self._raw_sinks[key] = cast("FsspecSink", sink)
                self._lane_pools[key] = ThreadPoolExecutor(
                    self.settings.publish_workers, thread_name_prefix="stagerd-raw"
                )
        if not self._raw_sinks:
            raise ConfigError(
                "--publish-raw needs an s3://, file:// or other fsspec sink: the Hub gets the HF export only",
                hint="add --sink s3://BUCKET/PREFIX or file:///PATH for the raw steps, or drop --publish-raw",
            )

    def _open_prune_stores(self) -> None:
        """Remote retention: a store per fsspec sink to list and delete with (the Hub is never pruned)."""
        from stagerd.sinks.fetch import RemoteStore
        from stagerd.sinks.prune import Owner, Policy, parse_policy

        s = self.settings
        # by place, as sinks are told apart: `/x` and `file:///x/` name the sink `file:///x`
        given = {place_of(u, what="--sink-retention URL"): (u, text) for u, text in s.sink_retention.items()}
        places = {place_of(url): url for url in s.sinks}
        unknown = [u for place, (u, _) in given.items() if place not in places]
        if unknown:
            named = sorted(redact_url(u) for u in unknown)  # a URL may carry a password
            raise ConfigError(
                f"sink_retention names sinks that are not --sink: {named}",
                hint=f"name one of the sinks: {sorted(redact_url(u) for u in s.sinks)}",
            )
        told = False
        for place, url in places.items():
            text = given.get(place, (url, None))[1]
            policy = parse_policy(text) if text else Policy(s.remote_keep_last, s.remote_keep_every)
            if policy.active and parse_sink_url(url).kind is not SinkKind.HUB:
                store = RemoteStore.open(url)
                # its own ROOT's steps only: a run sharing the prefix by mistake keeps its own
                roots = [] if self._adopt_root is None else [self._adopt_root]
                owner = Owner.of(self.root, *roots)
                self._prune_stores[store.url] = (store, policy, owner)
                ancestors = owner.publisher.ancestors if owner.publisher is not None else frozenset()
                if ancestors and not told:
                    told = True
                    log.info(
                        "remote retention also counts and prunes the steps of %d earlier ROOT(s) this ROOT "
                        "resumed from with `stagerd restore` (%s)",
                        len(ancestors),
                        ", ".join(sorted(a[:8] for a in ancestors)),
                    )

    def _serve_metrics(self) -> MetricsServer | None:
        if not self.settings.metrics_port:
            return None
        host, port = self.settings.metrics_host, self.settings.metrics_port
        try:
            server = MetricsServer(self.metrics, host, port, self._healthz)
        except OSError as e:
            if e.errno == errno.EADDRINUSE and self.settings.once:
                # A one-shot run is not scraped or probed: another daemon on this host holding the port
                # must not fail it. A running daemon still refuses: its probes and Prometheus would read
                # the other daemon's /healthz and metrics at this address as its own.
                log.warning(
                    "metrics port %s:%d is in use (another stagerd on this host?): this --once run serves "
                    "no metrics",
                    host,
                    port,
                )
                return None
            unresolved = isinstance(e, socket.gaierror)
            raise ConfigError(
                f"cannot serve metrics on {host}:{port}: {e.strerror or e}",
                hint=(
                    "give --metrics-host an address of this machine (default 127.0.0.1)"
                    if unresolved
                    else "pick a free --metrics-port"
                )
                + ", or --metrics-port 0 to turn the metrics server off",
            ) from None
        server.start()
        self.metrics_address = (str(server.host), server.port)
        log.info("metrics on http://%s:%d/metrics", server.host, server.port)
        return server

    def _on_signal(self, sig: int) -> None:
        if self._stopping:
            log.warning("second %s: abandoning in-flight work now", signal.Signals(sig).name)
            self.settings = self.settings.model_copy(update={"grace_seconds": 0.0})
            self._stop.set()
            return
        log.info(
            "%s: no new work; draining (grace %.0fs)",
            signal.Signals(sig).name,
            self.settings.grace_seconds,
            extra={"state": "stopping"},
        )
        self._stopping = True
        self._health["status"] = "stopping"
        notify.notify_stopping(f"draining, grace {self.settings.grace_seconds:.0f}s")
        notify.notify_extend_timeout(self.settings.grace_seconds + 10)
        self._stop.set()
        self._wake.set()

    async def _drain(self) -> None:
        """Wait for in-flight work up to the grace period; abandon (and journal) what is still running."""
        inflight: dict[tuple[int, str | None], asyncio.Task[None]] = {
            (s, None): t for s, t in self._inflight_exports.items()
        }
        for lane, task in self._inflight_publishes.items():
            inflight[lane] = task
        if not inflight:
            return
        if self._stopping:
            log.info("waiting for %d in-flight job(s)", len(inflight))
            deadline = time.monotonic() + self.settings.grace_seconds
            pending = set(inflight.values())
            while pending and time.monotonic() < deadline and self.settings.grace_seconds > 0:
                _, pending = await asyncio.wait(
                    pending, timeout=min(0.5, max(0.0, deadline - time.monotonic()))
                )
        else:
            await asyncio.gather(*inflight.values(), return_exceptions=True)
        for (step, sink), task in inflight.items():
            if task.done():
                continue
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
            try:
                await self._j(self._journal.abandon, step, sink, "abandoned at shutdown")
            except JournalError:
                continue  # it finished and recorded itself while we were cancelling it
            self.left_threads_running = True
            self._log_step(step, sink, COMMITTED if sink is None else PENDING, note="abandoned at shutdown")
