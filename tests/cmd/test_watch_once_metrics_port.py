"""`watch --once` needs no metrics server: a port another daemon on the host holds is a warning, and the
run does its work. A running daemon still refuses the port (tests/daemon/test_metrics_server.py)."""

from __future__ import annotations

import logging
import socket
from pathlib import Path

import pytest

from stagerd.cli import main


def test_watch_once_runs_beside_a_daemon_holding_the_metrics_port(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    root, sink = tmp_path / "root", tmp_path / "sink"
    root.mkdir()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        logger = logging.getLogger("stagerd")
        logger.addHandler(caplog.handler)  # the CLI's logger does not propagate to the root's
        try:
            argv = ["watch", str(root), "--sink", sink.as_uri(), "--once", "--metrics-port", str(port)]
            rc = main(argv)
        finally:
            logger.removeHandler(caplog.handler)
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert "cannot serve metrics" not in out.err
    said = [r.getMessage() for r in caplog.records]
    warned = f"metrics port 127.0.0.1:{port} is in use (another stagerd on this host?): this --once run"
    assert any(m.startswith(warned) for m in said), said
