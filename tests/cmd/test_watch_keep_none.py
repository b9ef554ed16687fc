"""`--keep-last 0` deletes every staged step once published, the newest too: meant, but a user may have typed
0 for "off", so the daemon's start says once what it costs (a resume from ROOT) and how to keep the newest."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stagerd.cli import main
from tests.daemon_helpers import fast_flags


def _start(tmp_path: Path, capsys: pytest.CaptureFixture[str], *flags: str) -> list[str]:
    root = tmp_path / "root"
    root.mkdir(exist_ok=True)
    argv = ["watch", str(root), "--sink", (tmp_path / "sink").as_uri(), "--once", *fast_flags()]
    assert main([*argv, *flags]) == 0
    records = [json.loads(ln) for ln in capsys.readouterr().err.splitlines() if ln.startswith("{")]
    return [r["msg"] for r in records if r["level"] == "warning" and "--keep-last 0" in r["msg"]]


def test_keep_last_0_warns_once_that_the_newest_step_goes_too(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lines = _start(tmp_path, capsys, "--keep-last", "0")
    assert len(lines) == 1, lines
    assert "the newest too" in lines[0] and "without --publish-raw" in lines[0], lines
    assert "--keep-last 1 keeps the newest" in lines[0], lines

    (raw,) = _start(tmp_path, capsys, "--keep-last", "0", "--publish-raw")
    assert "the newest too" in raw and "stagerd restore" in raw, raw
    assert "optimizer" not in raw, raw

    assert _start(tmp_path, capsys, "--keep-last", "1") == []
    assert _start(tmp_path, capsys) == []
    # adopted: only stagerd's exports go, the trainer's checkpoints stay, unless --delete-adopted
    assert _start(tmp_path, capsys, "--keep-last", "0", "--adopt") == []
    assert len(_start(tmp_path, capsys, "--keep-last", "0", "--adopt", "--delete-adopted")) == 1
