"""`pid_alive`: a live process is alive, an exited one is not, reaped or not (a zombie whose parent has not
reaped it holds no file, lock or lease any more)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from stagerd.ops.processes import pid_alive


def test_a_process_is_alive_until_it_exits_reaped_or_not():
    p = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        assert pid_alive(p.pid) and pid_alive(os.getpid())
        assert p.stdin is not None
        p.stdin.close()
        deadline = time.monotonic() + 30
        while pid_alive(p.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        # not reaped yet: its pid is still taken, os.kill(pid, 0) still succeeds
        stat = Path(f"/proc/{p.pid}/stat").read_text()
        assert stat.rsplit(")", 1)[1].split()[0] == "Z"
        assert not pid_alive(p.pid)
    finally:
        p.kill()
        p.wait()
    assert not pid_alive(p.pid)


def test_pids_no_process_can_have_are_not_alive():
    assert not pid_alive(0) and not pid_alive(-1) and not pid_alive(2**31)
