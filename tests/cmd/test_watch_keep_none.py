"""`--keep-last 0` deletes every staged step once published, the newest too: meant, but a user may have typed
0 for "off", so the daemon's start says once what it costs (a resume from ROOT) and how to keep the newest."""

from __future__ import annotations

import logging
from pathlib import Path

from stagerd.cli import main
from tests.daemon_helpers import fast_flags


class _Kept(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _start(tmp_path: Path, *flags: str) -> list[str]:
    """The warnings about --keep-last 0 of one `stagerd watch --once` start on an empty ROOT (read from the
    logger itself: the CLI's handler holds the stderr of the first test that ran it in this process)."""
    root = tmp_path / "root"
    root.mkdir(exist_ok=True)
    argv = ["watch", str(root), "--sink", (tmp_path / "sink").as_uri(), "--once", *fast_flags()]
    kept, logger = _Kept(), logging.getLogger("stagerd")
    logger.addHandler(kept)
    try:
        assert main([*argv, *flags]) == 0
    finally:
        logger.removeHandler(kept)
    return [m for m in kept.messages if "--keep-last 0" in m]


def test_keep_last_0_warns_once_that_the_newest_step_goes_too(tmp_path: Path) -> None:
    lines = _start(tmp_path, "--keep-last", "0")
    assert len(lines) == 1, lines
    assert "the newest too" in lines[0] and "without --publish-raw" in lines[0], lines
    assert "--keep-last 1 keeps the newest" in lines[0], lines

    (raw,) = _start(tmp_path, "--keep-last", "0", "--publish-raw")
    assert "the newest too" in raw and "stagerd restore" in raw, raw
    assert "optimizer" not in raw, raw

    assert _start(tmp_path, "--keep-last", "1") == []
    assert _start(tmp_path) == []
    # adopted: only stagerd's exports go, the trainer's checkpoints stay, unless --delete-adopted
    assert _start(tmp_path, "--keep-last", "0", "--adopt") == []
    assert len(_start(tmp_path, "--keep-last", "0", "--adopt", "--delete-adopted")) == 1
