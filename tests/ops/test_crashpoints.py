"""The crash-point mechanism itself (the daemon's kill cases are in tests/daemon/crash/test_injection.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from stagerd.ops.crashpoints import ENV
from tests.cli_helpers import REPO, clean_env


def test_crash_point_is_inert_without_the_variable_and_kills_at_the_nth_arrival():
    probe = (
        "from stagerd.ops.crashpoints import crash_point\n"
        "for i in range(1, 6):\n"
        "    crash_point('export.move'); crash_point('hub.commit')\n"
        "    print(i, flush=True)\n"
    )

    def run(value: str | None) -> subprocess.CompletedProcess[str]:
        env = clean_env({ENV: value} if value is not None else {})
        return subprocess.run(
            [sys.executable, "-c", probe], env=env, cwd=REPO, capture_output=True, text=True, timeout=30
        )

    r = run(None)
    assert r.returncode == 0 and r.stdout.split() == ["1", "2", "3", "4", "5"]
    r = run("hub.commit:3")
    assert r.returncode == -signal.SIGKILL and r.stdout.split() == ["1", "2"]
    assert "crash point hub.commit:3 reached" in r.stderr
    r = run("export.move")
    assert r.returncode == -signal.SIGKILL and r.stdout.split() == []
    r = run("no.such.point")
    assert r.returncode == 1 and "unknown crash point" in r.stderr
    assert os.environ.get(ENV) is None  # the test process itself never arms a crash point
