"""Scripted faults for the Hub test server: error statuses, 429 with Retry-After, dropped connections, hangs.

A test queues `Fault`s on `server.faults`; each request takes the first fault whose method and path
pattern match, until the fault's `times` are used up. "Down then up" is a server-level switch
(`HubServer.down()` / `up()` / `down_for()`), not a fault, because a down server accepts no request.
A hung request waits until `FaultPlan.release()` (or the server stops), then loses its connection.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class Fault:
    """Answer `times` matching requests with `status` (and `headers`), or drop them (`drop=True`).

    `path` is a regular expression searched in the request path (e.g. `r"/commit/"`, `r"^/_lfs/put/"`).
    `skip` lets that many matching requests through first. A drop closes the socket without a
    response after reading `drop_after` bytes of the request body: a connection lost mid-upload.
    `drop_response` handles the request for real, then drops the connection instead of answering:
    the work is done (a commit lands) but the client never hears of it.
    `hang` reads the whole request and never answers: a Hub that accepted the connection and stalls.
    `stall_after=N` handles the request for real, sends the status, the headers (with the full
    Content-Length) and the first N bytes of the body, then stalls: a response that stops mid-way.
    Both hold the connection until `FaultPlan.release()`, then drop it.
    `not_before` holds the fault's answer until it returns True (checked every 10 ms, for at most 10 s):
    an order between concurrent requests that would otherwise depend on thread scheduling.
    """

    method: str
    path: str
    status: int = 500
    times: int = 1
    skip: int = 0
    headers: dict[str, str] = field(default_factory=dict)
    body: str = '{"error": "injected fault"}'
    drop: bool = False
    drop_after: int = 0
    drop_response: bool = False
    hang: bool = False
    stall_after: int | None = None
    not_before: Callable[[], bool] | None = None
    fired: int = 0

    def wait_turn(self) -> None:
        deadline = time.monotonic() + 10
        while self.not_before is not None and not self.not_before() and time.monotonic() < deadline:
            time.sleep(0.01)

    def matches(self, method: str, path: str) -> bool:
        return self.method.upper() in (method.upper(), "*") and re.search(self.path, path) is not None


class FaultPlan:
    """The queue of pending faults; thread-safe."""

    def __init__(self) -> None:
        self._faults: list[Fault] = []
        self._lock = threading.Lock()
        self._release = threading.Event()

    def add(self, fault: Fault) -> Fault:
        with self._lock:
            self._faults.append(fault)
        return fault

    def remove(self, fault: Fault) -> None:
        with self._lock:
            self._faults = [f for f in self._faults if f is not fault]

    def clear(self) -> None:
        with self._lock:
            self._faults.clear()

    def hold(self) -> threading.Event:
        """The event a hung request waits on; set by the next `release()`."""
        with self._lock:
            return self._release

    def release(self) -> None:
        """Let every request hung so far go (each loses its connection); later hangs wait again."""
        with self._lock:
            event, self._release = self._release, threading.Event()
        event.set()

    def take(self, method: str, path: str) -> Fault | None:
        """The fault that applies to this request, if any, counting it as fired."""
        with self._lock:
            for f in self._faults:
                if f.fired < f.skip + f.times and f.matches(method, path):
                    f.fired += 1
                    if f.fired > f.skip:
                        return f
                    return None
            return None

    @property
    def pending(self) -> list[Fault]:
        with self._lock:
            return [f for f in self._faults if f.fired < f.skip + f.times]
