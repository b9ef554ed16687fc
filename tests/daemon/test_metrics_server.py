"""The metrics server answers only its two paths, and drops idle clients (issue 19, item 15)."""

from __future__ import annotations

import socket
import threading
import time
import urllib.error
import urllib.request

import pytest

from stagerd.daemon.metrics import Metrics, MetricsServer


@pytest.fixture
def server():
    srv = MetricsServer(Metrics(), "127.0.0.1", 0, lambda: (True, {"status": "ok"}), idle_timeout=0.5)
    srv.start()
    yield srv
    srv.close()


def _get(srv: MetricsServer, path: str) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{srv.port}{path}", timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def test_only_metrics_and_healthz_answer(server):
    assert _get(server, "/metrics") == 200 and _get(server, "/healthz") == 200
    for mistyped in ("/healthz/", "/HEALTHZ", "/", "/metrics/x", "/health"):
        assert _get(server, mistyped) == 404, mistyped


def test_idle_connections_are_closed_and_give_their_threads_back(server):
    before = threading.active_count()
    idle = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(20)]
    try:
        deadline = time.monotonic() + 10
        while threading.active_count() > before and time.monotonic() < deadline:
            time.sleep(0.1)
        assert threading.active_count() <= before, "idle connections kept their threads"
        for s in idle:
            s.settimeout(5)
            assert s.recv(1) == b""  # the server hung up
    finally:
        for s in idle:
            s.close()
    assert _get(server, "/healthz") == 200


def test_close_ends_the_serving_thread_and_frees_the_port():
    srv = MetricsServer(Metrics(), "127.0.0.1", 0, lambda: (True, {"status": "ok"}))
    srv.start()
    assert _get(srv, "/healthz") == 200
    srv.close()  # woken by its socket pair: no poll interval to wait out, and nothing left serving
    assert not srv._thread.is_alive()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", srv.port), timeout=5).close()
    srv.close()  # twice, as a stop after a failed start may


def test_the_fleet_wait_gauge_holds_the_steps_waiting_now_not_every_step_ever():
    """The fleet's calls as made for each step (waiting, then done): before, a series per step number stayed
    at 0 for good, one more series on every scrape for every fleet step the daemon ever exported."""
    from prometheus_client import generate_latest

    m = Metrics()
    for step in range(1000):
        m.fleet_waiting.labels(step=str(step)).set(2)  # waiting for 2 nodes
        m.fleet_waiting.labels(step=str(step)).set(0)  # the wait is over
    m.fleet_waiting.labels(step="1000").set(1)
    m.fleet_waiting.labels(step="1001").set(0)  # over before it waited: nothing to remove
    lines = [ln for ln in generate_latest(m.registry).decode().splitlines() if ln.startswith("stagerd_fleet")]
    assert lines == ['stagerd_fleet_waiting_nodes{step="1000"} 1.0']


@pytest.mark.parametrize("where", ["port", "host"])
def test_a_metrics_address_that_cannot_be_served_stops_watch_before_anything_is_written(tmp_path, where):
    """A second daemon on another ROOT, its metrics port taken by the first (or its host unresolvable):
    the ConfigError came only after the journal was made and every sink's lane recorded, and after the
    start-up's recovery and prunes had run. A running daemon, not --once: a one-shot run only warns of a
    port in use (tests/cmd/test_watch_once_metrics_port.py)."""
    from stagerd.daemon.journal.schema import journal_path
    from tests.cli_helpers import run_cli

    root = tmp_path / "root"
    root.mkdir()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        host = "127.0.0.1" if where == "port" else "no-such-host.invalid"
        r = run_cli(
            [
                "watch",
                root,
                "--sink",
                (tmp_path / "sink").as_uri(),
                "--metrics-host",
                host,
                "--metrics-port",
                str(port),
            ],
            timeout=60,  # were the port served, the daemon would run until killed
        )
    assert r.returncode == 2, r.stderr
    assert "cannot serve metrics" in r.stderr, r.stderr
    assert ("--metrics-host" in r.stderr) == (where == "host"), r.stderr
    assert not journal_path(root).exists()
    assert not (tmp_path / "sink").exists()
