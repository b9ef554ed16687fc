"""systemd's sd_notify protocol: readiness, watchdog pings, status and stopping, as datagrams.

The service manager passes a socket path in `$NOTIFY_SOCKET` (a leading `@` names an abstract socket).
Without it every call is a no-op that returns False, so the daemon can call these unconditionally under
Docker, Kubernetes or a terminal. A send that fails is logged once and never raised: losing a status
line must not stop the daemon. (A lost watchdog ping is what the watchdog exists to notice.)
"""

from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger("stagerd")

_warned = False


def _address() -> str | bytes | None:
    path = os.environ.get("NOTIFY_SOCKET")
    if not path:
        return None
    if path.startswith("@"):
        return b"\0" + path[1:].encode()
    return path


def notify(*assignments: str) -> bool:
    """Send `KEY=VALUE` lines as one datagram to `$NOTIFY_SOCKET`; True if sent."""
    global _warned
    addr = _address()
    if addr is None:
        return False
    payload = "\n".join(assignments).encode()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(addr)
            sock.sendall(payload)
    except OSError as e:
        if not _warned:
            _warned = True
            log.warning("sd_notify to %s failed: %s", os.environ.get("NOTIFY_SOCKET"), e)
        return False
    return True


def notify_ready(status: str | None = None) -> bool:
    """Tell systemd the service is up (`Type=notify`): the journal is open and the first scan is done."""
    lines = ["READY=1"]
    if status:
        lines.append(f"STATUS={_one_line(status)}")
    return notify(*lines)


def notify_watchdog() -> bool:
    """Ping the watchdog. Call at least twice per `watchdog_interval()`."""
    return notify("WATCHDOG=1")


def notify_stopping(status: str | None = None) -> bool:
    """Tell systemd the service is draining and will exit."""
    lines = ["STOPPING=1"]
    if status:
        lines.append(f"STATUS={_one_line(status)}")
    return notify(*lines)


def notify_status(text: str) -> bool:
    """Set the one-line status shown by `systemctl status`."""
    return notify(f"STATUS={_one_line(text)}")


def notify_extend_timeout(seconds: float) -> bool:
    """Ask for `seconds` more before systemd's start or stop timeout fires (a long drain)."""
    return notify(f"EXTEND_TIMEOUT_USEC={max(1, int(seconds * 1_000_000))}")


def watchdog_interval() -> float | None:
    """`WatchdogSec=` in seconds when the watchdog is armed for this process, else None.

    systemd sets `WATCHDOG_USEC`, and `WATCHDOG_PID` when the variable may have been inherited by a child.
    """
    usec = os.environ.get("WATCHDOG_USEC")
    if not usec:
        return None
    pid = os.environ.get("WATCHDOG_PID")
    if pid and pid.strip() != str(os.getpid()):
        return None
    try:
        value = int(usec)
    except ValueError:
        return None
    return value / 1_000_000 if value > 0 else None


def _one_line(text: str) -> str:
    return " ".join(text.split())
