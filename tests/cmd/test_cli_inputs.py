"""Inputs a command takes at its start and only finds wrong later, or never: each is named at once, before
anything is written or deleted. An exchange the store cannot take or reach (`watch` opens it as it opens
its sinks, not when a node-local step first needs it, hours later); a `file://` sink to prune that does not
exist (a typo, not a sink with nothing to prune); a copy-thread count past the daemon's own bound."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from stagerd.cli import main


def _one_error(err: str, kind: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.startswith("stagerd:")]
    assert len(lines) == 1 and lines[0].startswith(f"stagerd: {kind}: "), err
    assert "what to do:" in err and "Traceback" not in err, err
    return lines[0]


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # closed again: a connection there is refused


def test_watch_opens_the_exchange_at_start(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STAGERD_METRICS_PORT", "off")
    root, sink = tmp_path / "root", tmp_path / "sink"
    root.mkdir()
    argv = ["watch", str(root), "--sink", sink.as_uri(), "--once", "--exchange"]
    # an S3 store whose endpoint cannot be one: bad input, exit 2
    monkeypatch.setenv("AWS_ENDPOINT_URL", "minio:9000")
    assert main([*argv, "s3://bucket/exchange"]) == 2
    line = _one_error(capsys.readouterr().err, "ConfigError")
    assert "AWS_ENDPOINT_URL='minio:9000' has no scheme" in line
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    # a store that connects on open, whose host does not answer: as a sink that cannot be reached, exit 3
    url = f"ftp://127.0.0.1:{_closed_port()}/exchange"
    assert main([*argv, url]) == 3
    err = capsys.readouterr().err
    assert f"cannot reach --exchange {url}: ConnectionRefusedError" in _one_error(err, "SinkError")
    assert "every node reaches the exchange" in err
    assert list(root.iterdir()) == [] and not sink.exists()


def test_prune_of_a_missing_local_sink_is_an_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    afile = tmp_path / "afile"
    afile.write_text("mine")
    for where, what in ((tmp_path / "nonexistent", "sink does not exist"), (afile, "names a file")):
        for url in (where.as_uri(), str(where)):
            assert main(["prune", url, "--keep-last", "1"]) == 2
            line = _one_error(capsys.readouterr().err, "ConfigError")
            assert f"{where}: " in line and what in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"] and afile.read_text() == "mine"
    empty = tmp_path / "empty"  # a real sink with nothing published yet: nothing to prune, as before
    empty.mkdir()
    assert main(["prune", empty.as_uri(), "--keep-last", "1"]) == 0
    assert "nothing to prune" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["consolidate", "verify"])
@pytest.mark.parametrize("threads", ["0", "257", "100000"])
def test_threads_are_bounded(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], threads: str, command: str
) -> None:
    paths = [str(tmp_path / "src"), str(tmp_path / "out")][: 2 if command == "consolidate" else 1]
    assert main([command, *paths, "--threads", threads]) == 2
    line = _one_error(capsys.readouterr().err, "ConfigError")
    assert f"--threads must be between 1 and 256, got {threads}" in line
    assert list(tmp_path.iterdir()) == []
