"""Prometheus metrics and `/healthz`, served by prometheus-client's WSGI app on 127.0.0.1 by default.

The server runs in its own thread; `/healthz` answers 503 when the event loop has not beaten for
`stale_after` seconds, so a wedged loop shows up even though this thread still answers.
"""

from __future__ import annotations

import contextlib
import json
import selectors
import socket
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

_DURATION_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)
_LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60)


IDLE_TIMEOUT_SECONDS = 10.0


class Metrics:
    """Every metric the daemon exports, in a private registry."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.steps = Gauge("stagerd_steps", "Steps in the journal by state.", ["state"], registry=r)
        self.lanes = Gauge(
            "stagerd_lanes", "Publish lanes of live steps by sink and state.", ["sink", "state"], registry=r
        )
        self.exported_bytes = Counter(
            "stagerd_exported_bytes",
            "Bytes written into export directories (of a step several nodes build, this node's share).",
            registry=r,
        )
        self.published_bytes = Counter(
            "stagerd_published_bytes", "Bytes uploaded to each sink.", ["sink"], registry=r
        )
        self.export_seconds = Histogram(
            "stagerd_export_duration_seconds",
            "Export duration per step.",
            buckets=_DURATION_BUCKETS,
            registry=r,
        )
        self.publish_seconds = Histogram(
            "stagerd_publish_duration_seconds",
            "Publish duration per step and sink.",
            ["sink"],
            buckets=_DURATION_BUCKETS,
            registry=r,
        )
        self.pickup_seconds = Histogram(
            "stagerd_marker_to_export_start_seconds",
            "From the commit marker's mtime to the start of its export.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_depth = Gauge(
            "stagerd_queue_depth",
            "Work waiting: stage=export, or stage=publish per sink (pending and failed-awaiting-retry).",
            ["stage", "sink"],
            registry=r,
        )
        self.failures = Counter(
            "stagerd_failures",
            "Failed attempts by stage and error class.",
            ["stage", "error_class"],
            registry=r,
        )
        self.yield_seconds = Counter(
            "stagerd_yield_seconds",
            "Seconds exports (stage=export) and file:// publishes (stage=publish) paused for saves being "
            "written in ROOT.",
            ["stage"],
            registry=r,
        )
        self.disk_free = Gauge("stagerd_disk_free_bytes", "Free bytes on ROOT's filesystem.", registry=r)
        self.disk_low = Gauge(
            "stagerd_disk_low", "1 when ROOT's free space is below the threshold.", registry=r
        )
        self.oldest_unpublished = Gauge(
            "stagerd_oldest_unpublished_age_seconds",
            "Age of the oldest committed step not yet published on every sink (0 when none).",
            registry=r,
        )
        self.up_since = Gauge("stagerd_start_time_seconds", "When this daemon started.", registry=r)
        self.fleet_waiting = StepGauge(
            Gauge(
                "stagerd_fleet_waiting_nodes",
                "Node-locally staged steps: the other nodes this node is waiting for, by step (only steps "
                "waiting now).",
                ["step"],
                registry=r,
            )
        )
        self.up_since.set(time.time())

    def set_counts(
        self, steps: dict[str, int], lanes: dict[tuple[str, str], int], sinks: Iterable[str]
    ) -> None:
        """Refresh the state gauges from journal counts (zeros included, so a state drains to 0)."""
        for state, n in steps.items():
            self.steps.labels(state=state).set(n)
        from stagerd.daemon.journal import LANE_STATES

        for sink in sinks:
            for state in LANE_STATES:
                self.lanes.labels(sink=sink, state=state).set(lanes.get((sink, state), 0))


class StepGauge:
    """A gauge labeled by step, where 0 means "nothing to report": setting 0 removes the step's series.

    A series per step number kept at 0 forever would grow the scrape, and Prometheus' storage, by one
    series per step a long-running daemon has seen; this way it holds the steps waiting now."""

    def __init__(self, gauge: Gauge) -> None:
        self._gauge = gauge

    def labels(self, *, step: str) -> _StepSeries:
        return _StepSeries(self._gauge, step)


class _StepSeries:
    def __init__(self, gauge: Gauge, step: str) -> None:
        self._gauge, self._step = gauge, step

    def set(self, value: float) -> None:
        if value:
            self._gauge.labels(step=self._step).set(value)
        else:
            with contextlib.suppress(KeyError):  # never set, or removed already
                self._gauge.remove(self._step)


class _QuietHandler(WSGIRequestHandler):
    timeout = IDLE_TIMEOUT_SECONDS  # an idle or trickling client loses its thread

    def log_message(self, format: str, *args: Any) -> None:
        pass


class MetricsServer:
    """`/metrics` (Prometheus text) and `/healthz` (JSON) on host:port, in a daemon thread.

    Only those two paths answer 200: a mistyped probe (`/healthz/`, `/HEALTHZ`) must fail, not pass on the
    metrics body. A connection idle for `idle_timeout` seconds is closed, so idle clients cannot pile up
    threads where the server listens beyond localhost.
    """

    def __init__(
        self,
        metrics: Metrics,
        host: str,
        port: int,
        health: Callable[[], tuple[bool, dict[str, Any]]],
        *,
        idle_timeout: float = IDLE_TIMEOUT_SECONDS,
    ) -> None:
        prom = make_wsgi_app(metrics.registry)

        def app(environ: dict, start_response: Callable) -> list[bytes]:
            path = environ.get("PATH_INFO")
            if path == "/healthz":
                ok, body = health()
                start_response(
                    "200 OK" if ok else "503 Service Unavailable", [("Content-Type", "application/json")]
                )
                return [json.dumps(body).encode()]
            if path == "/metrics":
                return prom(environ, start_response)
            start_response("404 Not Found", [("Content-Type", "text/plain")])
            return [b"not found: stagerd serves /metrics and /healthz\n"]

        handler = type("_Handler", (_QuietHandler,), {"timeout": idle_timeout})
        self._server = make_server(host, port, app, ThreadingWSGIServer, handler_class=handler)
        self.host, self.port = self._server.server_address[:2]
        # `serve_forever` polls for its shutdown every 0.5 s, so stopping waited up to that long (every
        # `watch --once` paid it); a byte on this pair ends the loop at once, and an idle daemon never wakes.
        self._wake_r, self._wake_w = socket.socketpair()
        self._thread = threading.Thread(target=self._serve, name="stagerd-metrics", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _serve(self) -> None:
        with selectors.DefaultSelector() as selector:
            selector.register(self._server, selectors.EVENT_READ)
            selector.register(self._wake_r, selectors.EVENT_READ)
            while True:
                for key, _ in selector.select():
                    if key.fileobj is self._wake_r:
                        return
                    self._server.handle_request()

    def close(self) -> None:
        if self._thread.is_alive():
            self._wake_w.send(b"x")
            self._thread.join()
        self._server.server_close()
        self._wake_r.close()
        self._wake_w.close()
