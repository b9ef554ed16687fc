"""The fault-injecting proxy in front of moto (`tests/s3server.py` starts both): it checks SigV4, logs each
request by S3 operation, injects faults by rule, and can drop the conditional headers a store ignores."""

from __future__ import annotations

import hashlib
import http.client
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from tests.sigv4 import sigv4_denied

ACCESS_KEY = "stagerd-test-key"
IGNORE_ALL = {("PutObject", "if-none-match"), ("PutObject", "if-match"), ("DeleteObject", "if-match")}
SECRET_KEY = "stagerd-test-secret-do-not-log"
REGION = "us-east-1"
_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "expect"}
_HOP |= {"date", "server"}  # werkzeug sets its own
_MESSAGES = {
    "InvalidAccessKeyId": "The AWS Access Key Id you provided does not exist in our records.",
    "SignatureDoesNotMatch": "The request signature we calculated does not match the signature you provided.",
    "AccessDenied": "Access Denied",
}


def classify(method: str, path: str, query: dict[str, list[str]]) -> str:
    """The S3 operation name of a path-style request."""
    has_key = path.strip("/").count("/") >= 1
    if method == "PUT":
        if "partNumber" in query:
            return "UploadPart"
        return "PutObject" if has_key else "CreateBucket"
    if method == "POST":
        if "delete" in query:
            return "DeleteObjects"
        if "uploads" in query:
            return "CreateMultipartUpload"
        if "uploadId" in query:
            return "CompleteMultipartUpload"
        return "PostObject"
    if method == "DELETE":
        return "AbortMultipartUpload" if "uploadId" in query else "DeleteObject"
    if method == "HEAD":
        return "HeadObject" if has_key else "HeadBucket"
    if method == "GET":
        if not has_key:
            return "ListMultipartUploads" if "uploads" in query else "ListObjects"
        return "ListParts" if "uploadId" in query else "GetObject"
    return method


@dataclass
class Request:
    """One request the proxy saw: operation, object key (`bucket/key`), body bytes received, answer."""

    op: str
    key: str
    body_bytes: int
    status: int
    content_sha256: str = ""  # the signed payload hash (`x-amz-content-sha256`), checked against the body


@dataclass
class Fault:
    """Answer the next `times` matching requests with `status` (and `code`), or drop them mid-body."""

    ops: tuple[str, ...]
    times: int
    status: int = 500
    code: str = "InternalError"
    retry_after: int | None = None
    drop_after: int | None = None  # drop the connection after reading this many body bytes
    key_contains: str = ""
    after: int = 0  # let this many matching requests through first

    def matches(self, op: str, key: str) -> bool:
        return (not self.ops or op in self.ops) and self.key_contains in key


@dataclass
class FaultProxy:
    """The WSGI app in front of moto. See the module docstring."""

    upstream: tuple[str, int]
    keys: dict[str, str] = field(default_factory=lambda: {ACCESS_KEY: SECRET_KEY})
    faults: list[Fault] = field(default_factory=list)
    log: list[Request] = field(default_factory=list)
    is_down: bool = False
    ignores: set[tuple[str, str]] = field(default_factory=set)  # (operation, lower-case header) dropped
    slow: dict[str, float] = field(default_factory=dict)  # operation -> seconds each waits before it goes on
    _lock: threading.Lock = field(default_factory=threading.Lock)

    # -- test helpers --------------------------------------------------------------------------------------

    def add(self, fault: Fault) -> Fault:
        with self._lock:
            self.faults.append(fault)
        return fault

    def reset(self) -> None:
        with self._lock:
            self.faults.clear()
            self.log.clear()
            self.ignores.clear()
            self.slow.clear()

    def count(self, *ops: str, key_contains: str = "") -> int:
        with self._lock:
            return sum(1 for r in self.log if (not ops or r.op in ops) and key_contains in r.key)

    def bytes_in(self, *ops: str) -> int:
        with self._lock:
            return sum(r.body_bytes for r in self.log if not ops or r.op in ops)

    # -- WSGI ----------------------------------------------------------------------------------------------

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        method = environ["REQUEST_METHOD"]
        raw_uri = environ.get("RAW_URI") or environ.get("REQUEST_URI") or environ["PATH_INFO"]
        path, _, query_string = raw_uri.partition("?")
        query = urllib.parse.parse_qs(query_string, keep_blank_values=True)
        op = classify(method, urllib.parse.unquote(path), query)
        key = urllib.parse.unquote(path).lstrip("/")
        if op == "ListObjects" and query.get("prefix"):
            key = f"{key}/{query['prefix'][0]}"  # which listing: a probe's tidy-up lists its scratch keys
        headers = {k[5:].replace("_", "-").lower(): v for k, v in environ.items() if k.startswith("HTTP_")}
        for k in ("CONTENT_TYPE", "CONTENT_LENGTH"):
            if environ.get(k):
                headers[k.replace("_", "-").lower()] = environ[k]
        length = int(environ.get("CONTENT_LENGTH") or 0)
        stream = environ["wsgi.input"]

        if self.is_down:
            return self._drop(environ, op, key, 0)
        fault = self._take_fault(op, key)
        if fault is not None and fault.drop_after is not None:
            got = len(stream.read(min(fault.drop_after, length))) if length else 0
            return self._drop(environ, op, key, got)
        body = stream.read(length) if length else b""
        if op in self.slow:
            time.sleep(self.slow[op])
        if fault is not None:
            f = fault
            return self._error(start_response, op, key, len(body), f.status, f.code, f.retry_after)
        denied = sigv4_denied(self.keys, method, path, query_string, headers)
        if denied is not None:
            return self._error(start_response, op, key, len(body), 403, denied, None)
        signed = headers.get("x-amz-content-sha256", "")
        if len(signed) == 64 and signed != hashlib.sha256(body).hexdigest():  # as S3 checks it
            return self._error(start_response, op, key, len(body), 400, "XAmzContentSHA256Mismatch", None)
        headers = {k: v for k, v in headers.items() if (op, k) not in self.ignores}
        status, out_headers, data = self._forward(method, raw_uri, headers, body)
        self._record(op, key, len(body), status, signed)
        start_response(f"{status} {http.client.responses.get(status, '')}", out_headers)
        return [] if method == "HEAD" else [data]

    def _take_fault(self, op: str, key: str) -> Fault | None:
        with self._lock:
            for f in self.faults:
                if f.times > 0 and f.matches(op, key):
                    if f.after > 0:
                        f.after -= 1
                        return None
                    f.times -= 1
                    return f
        return None

    def _record(self, op: str, key: str, n: int, status: int, signed: str = "") -> None:
        with self._lock:
            self.log.append(Request(op, key, n, status, signed))

    def _drop(self, environ: dict[str, Any], op: str, key: str, n: int) -> Iterable[bytes]:
        self._record(op, key, n, 0)
        sock: socket.socket = environ["werkzeug.socket"]
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        raise ConnectionAbortedError("fault injection: connection dropped")

    def _error(
        self,
        start_response: Callable[..., Any],
        op: str,
        key: str,
        n: int,
        status: int,
        code: str,
        retry_after: int | None,
    ) -> Iterable[bytes]:
        self._record(op, key, n, status)
        message = _MESSAGES.get(code, f"injected {code}")
        body = (
            f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code>'
            f"<Message>{message}</Message><RequestId>fault</RequestId></Error>"
        ).encode()
        headers = [("Content-Type", "application/xml"), ("Content-Length", str(len(body)))]
        if retry_after is not None:
            headers.append(("Retry-After", str(retry_after)))
        start_response(f"{status} {http.client.responses.get(status, 'Error')}", headers)
        return [body]

    def _forward(
        self, method: str, raw_uri: str, headers: dict[str, str], body: bytes
    ) -> tuple[int, list[tuple[str, str]], bytes]:
        conn = http.client.HTTPConnection(*self.upstream, timeout=120)
        try:
            fwd = {k: v for k, v in headers.items() if k not in _HOP}
            fwd["content-length"] = str(len(body))
            conn.request(method, raw_uri, body=body, headers=fwd)
            resp = conn.getresponse()
            data = resp.read()
            skip = _HOP | {"content-length"}
            out = [(k, v) for k, v in resp.getheaders() if k.lower() not in skip]
            if method == "HEAD":
                out.append(("Content-Length", resp.getheader("Content-Length", "0")))
            else:
                out.append(("Content-Length", str(len(data))))
            return resp.status, out, data
        finally:
            conn.close()
