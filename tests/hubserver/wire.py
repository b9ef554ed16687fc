"""What the Hub test server's parts share: its settings and stats, the API error, and the JSON helpers."""

from __future__ import annotations

import json
import re
import socket
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from werkzeug.wrappers import Request, Response

_HEX40 = re.compile(r"^[0-9a-f]{40}$")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack", ".onnx")
_REGULAR_MAX = 10 * 1024 * 1024  # the Hub stores larger files in LFS whatever their name


class HubFail(Exception):
    """An API error answered as JSON, with the Hub's X-Error-Code / X-Error-Message headers."""

    def __init__(
        self, status: int, message: str, code: str | None = None, headers: dict | None = None, **extra: Any
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.code = status, message, code
        self.headers = dict(headers or {})
        self.extra = extra


@dataclass
class HubConfig:
    """Tunables of one server. Small values exercise multipart and pagination in tests."""

    multipart_threshold: int = 64 * 1024 * 1024
    multipart_chunk_size: int = 16 * 1024 * 1024
    tree_page_size: int = 1000
    commits_page_size: int = 50  # commits per page when the request names no `limit`
    commits_page_max: int = 1000  # the largest `limit` honoured
    xet_token_ttl: int = 3600  # seconds a CAS token lives
    # Rebuild each Xet file from its xorbs when its shard arrives, checking its sha256, and keep it where an
    # LFS object would be (for `resolve` without Xet and for tests reading the store); off for benchmarks.
    xet_materialize: bool = True
    strict: bool = True  # a request no route serves fails the test when the server stops


@dataclass
class RequestLog:
    method: str
    path: str
    status: int
    at: float
    authorization: bool
    user_agent: str = ""


@dataclass
class HubStats:
    """What the server saw, for assertions: every request, LFS uploads per oid, commits per repo."""

    requests: list[RequestLog] = field(default_factory=list)
    lfs_uploads: Counter = field(default_factory=Counter)  # sha256 -> completed uploads
    bytes_received: int = 0  # upload bodies: LFS objects and parts, xorbs, shards
    xorb_uploads: Counter = field(default_factory=Counter)  # xorb hash -> POSTs answered 200
    xet_bytes: Counter = field(default_factory=Counter)  # "xorb", "shard" (received), "read" (xorbs sent)
    xet_tokens: Counter = field(default_factory=Counter)  # "read"/"write" -> CAS tokens issued
    telemetry: list = field(default_factory=list)  # hf_xet's transfer reports
    unknown: list = field(default_factory=list)  # "METHOD /path" of requests no route serves
    commits: Counter = field(default_factory=Counter)  # repo_id -> commits made through the API
    commits_served: int = 0  # commit entries sent by the history endpoint
    commit_adds: list = field(default_factory=list)  # per commit made, the paths it added (file, lfsFile)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def count(self, method: str, pattern: str, status: int | None = None) -> int:
        """How many requests matched `method` and the path regex `pattern` (and `status`, if given)."""
        with self.lock:
            return sum(
                1
                for r in self.requests
                if r.method == method
                and re.search(pattern, r.path)
                and (status is None or r.status == status)
            )

    def times(self, method: str, pattern: str) -> list[float]:
        with self.lock:
            return [r.at for r in self.requests if r.method == method and re.search(pattern, r.path)]


@dataclass
class LfsBodyHook:
    """Calls `fn()` once, from the server thread, when the `nth` LFS upload request (a basic PUT or one
    multipart part) to receive `after` bytes of its body has received them: mid-upload, by design."""

    after: int
    fn: Callable[[], None]
    nth: int = 1
    crossed: int = 0
    fired: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)

    def progress(self, before: int, now: int) -> None:
        """One request's body went from `before` to `now` bytes."""
        if not before < self.after <= now:
            return
        with self.lock:
            self.crossed += 1
            fire = self.crossed == self.nth
            self.fired = self.fired or fire
        if fire:
            self.fn()


def _drop_connection(environ: dict) -> None:
    """Close the client's socket without an answer; werkzeug treats the error as a dropped connection."""
    sock: socket.socket = environ["werkzeug.socket"]
    sock.shutdown(socket.SHUT_RDWR)
    raise ConnectionAbortedError("injected fault: connection dropped")


def _int_arg(request: Request, name: str, default: int, minimum: int) -> int:
    value = request.args.get(name)
    if value is None:
        return default
    if not value.isdigit() or int(value) < minimum:
        raise HubFail(400, f"invalid {name}={value!r}: expected an integer >= {minimum}")
    return int(value)


def _json(data: Any, status: int = 200, headers: dict | None = None) -> Response:
    response = Response(json.dumps(data), status=status, mimetype="application/json")
    for k, v in (headers or {}).items():
        response.headers[k] = v
    return response
