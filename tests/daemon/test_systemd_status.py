"""The line `systemctl status` shows: a publish that keeps failing, and a lane quarantined while its step
is not, are named there, not only counted as work waiting."""

from __future__ import annotations

import asyncio
import socket
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from stagerd.config import Settings
from stagerd.contract import layout
from stagerd.daemon.core import Daemon
from stagerd.daemon.journal import Journal
from stagerd.errors import SinkError, VerifyError


def test_failing_and_quarantined_lanes_show_in_the_status_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    path = tmp_path / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.settimeout(5)
    monkeypatch.setenv("NOTIFY_SOCKET", str(path))
    root = tmp_path / "root"
    root.mkdir()
    down, bad = f"file://{tmp_path}/down", f"file://{tmp_path}/bad"
    d = Daemon(Settings(root=str(root), sinks=[down, bad], metrics_port=0))
    d._journal = j = Journal.open(root)
    d._jpool, d._iopool = ThreadPoolExecutor(1), ThreadPoolExecutor(1)
    d._wake, d._housekeep, d._stop = asyncio.Event(), asyncio.Event(), asyncio.Event()
    try:
        j.add_step(1, root / layout.step_dir_name(1), 1.0, "sha256:x")
        j.begin_export(1)
        j.finish_export(1, [down, bad], seconds=1, export_bytes=1, tensor_bytes=1, files=1, skipped=False)
        for sink, err in (
            (down, SinkError("connection refused", path=down)),
            (bad, VerifyError("torn", path=bad)),
        ):
            j.begin_publish(1, sink)
            asyncio.run(d._work_failed(1, sink, 1, err))
        asyncio.run(d._refresh())
        line = sock.recv(4096).decode()
    finally:
        j.close()
        sock.close()
    assert line.startswith("STATUS=0 published, 0 to export, "), line
    assert "1 retrying after a failure" in line and "1 sink lane(s) quarantined" in line, line
