"""sd_notify against a real AF_UNIX datagram socket, filesystem and abstract."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from stagerd.ops import notify


def _receiver(addr: str | bytes) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(addr)
    sock.settimeout(5)
    return sock


def _recv(sock: socket.socket) -> list[str]:
    return sock.recv(4096).decode().split("\n")


@pytest.fixture
def fs_socket(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    path = tmp_path / "notify.sock"
    sock = _receiver(str(path))
    monkeypatch.setenv("NOTIFY_SOCKET", str(path))
    yield sock
    sock.close()


def test_ready_watchdog_status_stopping(fs_socket: socket.socket) -> None:
    assert notify.notify_ready("journal open, 3 steps found")
    assert _recv(fs_socket) == ["READY=1", "STATUS=journal open, 3 steps found"]
    assert notify.notify_watchdog()
    assert _recv(fs_socket) == ["WATCHDOG=1"]
    assert notify.notify_status("exporting step 100\nand more")
    assert _recv(fs_socket) == ["STATUS=exporting step 100 and more"]
    assert notify.notify_extend_timeout(2.5)
    assert _recv(fs_socket) == ["EXTEND_TIMEOUT_USEC=2500000"]
    assert notify.notify_stopping("draining")
    assert _recv(fs_socket) == ["STOPPING=1", "STATUS=draining"]


def test_abstract_socket(monkeypatch: pytest.MonkeyPatch) -> None:
    name = f"stagerd-test-{uuid.uuid4().hex}"
    sock = _receiver(b"\0" + name.encode())
    try:
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        assert notify.notify_ready()
        assert _recv(sock) == ["READY=1"]
    finally:
        sock.close()


def test_noop_without_socket(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert notify.notify_ready() is False
    assert notify.notify_watchdog() is False


def test_dead_socket_is_not_fatal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "nobody-listens.sock"))
    assert notify.notify_watchdog() is False


def test_child_process_reaches_socket(fs_socket: socket.socket) -> None:
    """The daemon runs as its own process under systemd; the protocol must work from one."""
    code = "from stagerd.ops.notify import notify_ready; import sys; sys.exit(0 if notify_ready() else 1)"
    proc = subprocess.run([sys.executable, "-c", code], env=os.environ.copy(), timeout=60)
    assert proc.returncode == 0
    assert _recv(fs_socket) == ["READY=1"]


def test_watchdog_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WATCHDOG_USEC", raising=False)
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    assert notify.watchdog_interval() is None
    monkeypatch.setenv("WATCHDOG_USEC", "30000000")
    assert notify.watchdog_interval() == 30.0
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    assert notify.watchdog_interval() == 30.0
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid() + 1))
    assert notify.watchdog_interval() is None
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    monkeypatch.setenv("WATCHDOG_USEC", "0")
    assert notify.watchdog_interval() is None
    monkeypatch.setenv("WATCHDOG_USEC", "junk")
    assert notify.watchdog_interval() is None
