"""What `systemctl status` and the gauges show of the sink lanes: a publish that keeps failing, a lane
quarantined while its step is not, and a sink's raw lane (--publish-raw), each counted where it is."""

from __future__ import annotations

import asyncio
import socket
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from stagerd.config import Settings
from stagerd.contract import layout
from stagerd.daemon.core import Daemon
from stagerd.daemon.journal import Journal
from stagerd.daemon.journal.raw import raw_lane
from stagerd.errors import SinkError, VerifyError
from stagerd.sinks import open_sink


def test_failing_quarantined_and_raw_lanes_show_in_the_status_line_and_gauges(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.settimeout(5)
    monkeypatch.setenv("NOTIFY_SOCKET", str(path))
    root = tmp_path / "root"
    root.mkdir()
    down, bad = f"file://{tmp_path}/down", f"file://{tmp_path}/bad"
    d = Daemon(Settings(root=str(root), sinks=[down, bad], publish_raw=True, metrics_port=0))
    d._journal = j = Journal.open(root)
    d._jpool, d._iopool = ThreadPoolExecutor(1), ThreadPoolExecutor(1)
    d._wake, d._housekeep, d._stop = asyncio.Event(), asyncio.Event(), asyncio.Event()
    for url in (down, bad):
        d._sinks[url] = open_sink(url)
        d._lane_pools[url] = ThreadPoolExecutor(1)
    d._open_raw_lanes()
    try:
        j.add_step(1, root / layout.step_dir_name(1), 1.0, "sha256:x")
        for url in (down, bad):
            j.add_raw_lane(1, raw_lane(url))
        j.begin_raw(1, raw_lane(down))
        asyncio.run(d._work_failed(1, raw_lane(down), 1, SinkError("connection refused", path=down)))
        j.begin_export(1)
        j.finish_export(1, [down, bad], seconds=1, export_bytes=1, tensor_bytes=1, files=1, skipped=False)
        j.begin_publish(1, bad)
        asyncio.run(d._work_failed(1, bad, 1, VerifyError("torn", path=bad)))
        asyncio.run(d._refresh())
        line = sock.recv(4096).decode()
        metrics = generate_latest(d.metrics.registry).decode()
    finally:
        j.close()
        sock.close()
        for pool in d._lane_pools.values():
            pool.shutdown()
    # pending: down's export lane and bad's raw lane; down's raw lane failed (waiting to retry)
    assert line.startswith("STATUS=0 published, 0 to export, 3 to publish, 0 quarantined"), line
    assert "1 retrying after a failure" in line and "1 sink lane(s) quarantined" in line, line
    assert f'stagerd_lanes{{sink="{raw_lane(down)}",state="failed"}} 1.0' in metrics
    assert f'stagerd_queue_depth{{sink="{raw_lane(bad)}",stage="publish"}} 1.0' in metrics
    assert f'stagerd_lanes{{sink="{bad}",state="quarantined"}} 1.0' in metrics
