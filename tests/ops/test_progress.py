"""Progress: throttled plain log lines off a TTY, a rich bar on a real pseudo-terminal."""

from __future__ import annotations

import logging
import os
import pty
import select
import subprocess
import sys
import threading
import time

import pytest

from stagerd.ops import progress as progress_mod
from stagerd.ops.progress import progress


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def lines():
    logger = logging.getLogger("stagerd")
    handler, old_level = _Lines(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(old_level)


def test_plain_lines_one_per_tenth(lines: _Lines) -> None:
    with progress("export step 7", 10_000, tty=False) as cb:
        for done in range(0, 10_001, 7):
            cb(done, 10_000)
        cb(10_000, 10_000)
        cb(10_000, 10_000)
    msgs = [r.getMessage() for r in lines.records]
    assert 10 <= len(msgs) <= 11, msgs
    assert all(m.startswith("export step 7: ") for m in msgs)
    assert "(100%)" in msgs[-1] and "10.0 kB / 10.0 kB" in msgs[-1]
    assert sum("(100%)" in m for m in msgs) == 1
    assert lines.records[-1].progress_done == 10_000


def test_plain_lines_every_few_seconds_when_slow(lines: _Lines, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(progress_mod, "LOG_EVERY_SECONDS", 0.05)
    with progress("upload", 1000, unit="files", tty=False) as cb:
        for done in range(1, 6):  # all inside the first 10%
            time.sleep(0.06)
            cb(done, 1000)
    msgs = [r.getMessage() for r in lines.records]
    assert len(msgs) == 5, msgs
    assert msgs[0].startswith("upload: 1 files / 1,000 files (0%)")


def test_plain_lines_quiet_between_tenths(lines: _Lines) -> None:
    with progress("upload", 1000, tty=False) as cb:
        for done in range(1, 100):  # under 10%, fast: nothing due yet
            cb(done, 1000)
        assert lines.records == []
    # the end of the operation is logged once, with where it got to
    assert [r.getMessage().split(" in ")[0] for r in lines.records] == ["upload: 99 bytes / 1.0 kB (9%)"]


def test_plain_callback_is_thread_safe(lines: _Lines) -> None:
    total = 8 * 5000
    counter = iter(range(1, total + 1))
    counter_lock = threading.Lock()

    with progress("parallel", total, tty=False) as cb:

        def work() -> None:
            for _ in range(5000):
                with counter_lock:
                    done = next(counter)
                cb(done, total)

        threads = [threading.Thread(target=work) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    msgs = [r.getMessage() for r in lines.records]
    assert sum("(100%)" in m for m in msgs) == 1
    assert len(msgs) <= 11


def test_total_known_late(lines: _Lines) -> None:
    """Callers may open the bar with total 0 and learn the total from the first callback."""
    with progress("consolidate", 0, tty=False) as cb:
        cb(0, 0)
        cb(0, 4000)
        cb(4000, 4000)
    msgs = [r.getMessage().split(" in ")[0] for r in lines.records]
    assert msgs == ["consolidate: 4.0 kB / 4.0 kB (100%)"]


def test_empty_operation_logs_its_end(lines: _Lines) -> None:
    with progress("nothing", 0, tty=False) as cb:
        cb(0, 0)
    assert [r.getMessage().split(" in ")[0] for r in lines.records] == ["nothing: 0 bytes / 0 bytes (100%)"]


def test_failed_operation_does_not_claim_the_end(lines: _Lines) -> None:
    with pytest.raises(RuntimeError), progress("upload", 1000, tty=False) as cb:
        cb(10, 1000)
        raise RuntimeError("dropped")
    assert lines.records == []


def _run_on_pty(code: str) -> str:
    master, slave = pty.openpty()
    env = {**os.environ, "COLUMNS": "120", "TERM": "xterm"}
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=slave, stdout=slave, stderr=slave, env=env)
    os.close(slave)
    out = b""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        ready, _, _ = select.select([master], [], [], 0.5)
        if ready:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not chunk:
                break
            out += chunk
        elif proc.poll() is not None:
            break
    proc.wait(timeout=10)
    os.close(master)
    assert proc.returncode == 0, out.decode(errors="replace")
    return out.decode(errors="replace")


def test_rich_bar_on_a_terminal() -> None:
    code = (
        "from stagerd.ops.progress import progress\n"
        "import threading\n"
        "with progress('consolidate step 3', 2_000_000) as a, progress('steps', 4, unit='steps') as b:\n"
        "    t = threading.Thread(target=lambda: [a(i * 200_000, 2_000_000) for i in range(11)])\n"
        "    t.start(); t.join()\n"
        "    for i in range(5): b(i, 4)\n"
    )
    out = _run_on_pty(code)
    assert "consolidate step 3" in out
    assert "2.0 MB/2.0 MB" in out
    assert "4/4 steps" in out
    assert "\x1b[" in out  # a live, styled display, not log lines
