"""ROOT's lock held from another pid namespace, as in a Kubernetes pod whose daemon and training
containers share ROOT, not their pids: `stagerd status` and the refusals of the other container say a
process there holds ROOT, never "not running", and never name the local process whose pid the lock file
holds.

Before the fix the lock file's pid was believed in any namespace (the holder's pid 1 named this host's
init as the daemon), and a holder /proc/locks does not list (the kernel lists only the locks of processes
its /proc's namespace sees) was no daemon at all."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from stagerd.daemon.journal import Journal
from stagerd.daemon.lock import RootLock, lock_path
from tests.cli_helpers import STAGERD, clean_env, run_cli
from tests.pid_namespaces import OWN_PROC, UNSHARE, unshare_works

# Run in a new pid namespace: hold ROOT's lock, say our pid as this test's namespace knows it (NSpid's
# first), then hold on until stdin closes.
_HOLDER = """
import sys
from stagerd.daemon.journal import Journal
from stagerd.daemon.lock import RootLock
lock = RootLock(sys.argv[1], sys.argv[2])
lock.acquire()
nspid = next(ln for ln in open("/proc/self/status") if ln.startswith("NSpid:")).split()
print(nspid[1], nspid[-1], flush=True)
sys.stdin.read()
"""


def _root(tmp_path: Path) -> Path:
    """A ROOT with a journal, as a daemon's first start leaves it."""
    root = tmp_path / "root"
    root.mkdir()
    Journal.open(root).close()
    return root


def _status(root: Path, *prefix: str) -> dict:
    r = subprocess.run(
        [*prefix, *STAGERD, "status", str(root), "--json"],
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.mark.skipif(not unshare_works(), reason="no unprivileged user and pid namespaces here")
@pytest.mark.parametrize("command", ["watch", "restore"])
def test_a_holder_in_another_pid_namespace_is_named_by_its_pid_here(tmp_path, command):
    root = _root(tmp_path)
    holder = subprocess.Popen(
        [*UNSHARE, sys.executable, "-c", _HOLDER, str(root), command],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=clean_env(),
    )
    assert holder.stdout is not None and holder.stdin is not None
    try:
        here, there = map(int, holder.stdout.readline().split())
        assert there == 1 and lock_path(root).read_text().split()[0] == "1"  # its pid in its namespace
        doc = _status(root)
        assert doc["daemon_pid"] == here, doc  # not pid 1, this namespace's init
        assert doc["holder"] == command and not doc["held_elsewhere"]
    finally:
        holder.stdin.close()  # its end: a kill of `unshare` would leave the holder running
        holder.wait(timeout=60)
    assert _status(root)["daemon_pid"] is None


@pytest.mark.skipif(not unshare_works(OWN_PROC), reason="no unprivileged pid namespace with its own /proc")
def test_a_holder_another_container_cannot_see_is_a_daemon_there_not_none(tmp_path):
    root, sink = _root(tmp_path), tmp_path / "sink"
    sink.mkdir()
    with RootLock(root):
        doc = _status(root, *OWN_PROC)
        assert doc["daemon_pid"] is None and doc["held_elsewhere"] and doc["holder"] == "watch", doc
        r = subprocess.run(
            [*OWN_PROC, *STAGERD, "status", str(root)], env=clean_env(), capture_output=True, text=True
        )
        assert "running (in another container (pid namespace))" in r.stdout, r.stdout
        assert "not running" not in r.stdout
        r = subprocess.run(
            [*OWN_PROC, *STAGERD, "restore", sink.as_uri(), str(root)],
            env=clean_env(),
            capture_output=True,
            text=True,
        )
        assert r.returncode != 0
        assert "already watched by stagerd (a process in another container (pid namespace))" in r.stderr
    with RootLock(root, "restore"):
        doc = _status(root, *OWN_PROC)
        assert doc["held_elsewhere"] and doc["holder"] == "restore", doc
    doc = _status(root, *OWN_PROC)
    assert doc["daemon_pid"] is None and not doc["held_elsewhere"]
    assert run_cli(["status", root]).returncode == 0
    assert os.path.exists(lock_path(root))
