"""A real S3 endpoint for the tests: moto's `ThreadedMotoServer` on 127.0.0.1, behind a fault-injecting proxy.

The proxy is a small threaded WSGI server (werkzeug) that forwards every request to moto over HTTP, and on
the way:
- checks the AWS SigV4 signature against the keys it knows (`tests/sigv4.py`: `InvalidAccessKeyId` /
  `SignatureDoesNotMatch`, both 403, as S3 answers), so a test can prove how bad credentials end;
- logs every request by S3 operation, so a test can count what a client really sent;
- injects faults by rule: N answers of a status (500 InternalError, 503 SlowDown, 429 with Retry-After),
  a connection dropped after part of the request body, and a server that is down (listener closed, open
  connections cut) and comes back up;
- models a store that ignores conditional requests (`ignores`: the If-Match / If-None-Match headers of
  the operations named are dropped on the way to moto, after the signature check), as some S3-compatible
  stores do: they answer 2xx and overwrite or delete anyway.

Nothing here touches a client: clients are real s3fs/boto3 pointed at `proxy.endpoint`.

Fixtures: `s3_server` (session: moto + proxy) and `s3` (per test: faults cleared, log cleared, dummy
credentials in the environment, a fresh bucket). Import both into a test module to use them.
"""

from __future__ import annotations

import hashlib
import http.client
import logging
import socket
import threading
import time
import urllib.parse
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from werkzeug.serving import BaseWSGIServer, WSGIRequestHandler, make_server

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


class _QuietHandler(WSGIRequestHandler):
    def log_request(self, *args: Any, **kwargs: Any) -> None:
        pass

    def log_error(self, *args: Any) -> None:
        pass


class S3TestServer:
    """moto's ThreadedMotoServer on a free 127.0.0.1 port, and the fault proxy on another."""

    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto logs every request otherwise
        self.moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self.moto.start()
        self.proxy = FaultProxy(upstream=self.moto.get_host_and_port())
        self._port = 0
        self._server: BaseWSGIServer | None = None
        self._thread: threading.Thread | None = None
        self.up()

    @property
    def endpoint(self) -> str:
        """The proxy: what clients under test talk to."""
        return f"http://127.0.0.1:{self._port}"

    def aws_env(self, absent: Path) -> dict[str, str]:
        """The AWS environment of a client of this server: dummy credentials, the proxy's endpoint, and no
        config, credentials file (`absent`: a path that does not exist) or instance metadata to read."""
        return {
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_DEFAULT_REGION": REGION,
            "AWS_ENDPOINT_URL_S3": self.endpoint,
            "AWS_CONFIG_FILE": str(absent),
            "AWS_SHARED_CREDENTIALS_FILE": str(absent),
            "AWS_EC2_METADATA_DISABLED": "true",
        }

    @property
    def moto_endpoint(self) -> str:
        """moto itself, with no faults and no auth check: for setup and for reading back."""
        host, port = self.moto.get_host_and_port()
        return f"http://{host}:{port}"

    def up(self) -> None:
        """Start (or restart, on the same port) the proxy's listener."""
        self._server = make_server(
            "127.0.0.1", self._port, self.proxy, threaded=True, request_handler=_QuietHandler
        )
        self._port = self._server.server_port
        self.proxy.is_down = False
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def down(self) -> None:
        """Close the listener (new connections are refused) and cut requests on open connections."""
        self.proxy.is_down = True
        assert self._server is not None
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join()

    def down_for(self, seconds: float) -> threading.Thread:
        """Go down now and come back up after `seconds`, in the background."""
        self.down()

        def later() -> None:
            time.sleep(seconds)
            self.up()

        t = threading.Thread(target=later, daemon=True)
        t.start()
        return t

    def client(self, *, direct: bool = True) -> Any:
        """A boto3 S3 client, straight to moto by default."""
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.moto_endpoint if direct else self.endpoint,
            aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY,
            region_name=REGION,
        )

    def stop(self) -> None:
        if self._server is not None and not self.proxy.is_down:
            self.down()
        self.moto.stop()


@dataclass
class S3Env:
    """What one test gets: the server, a fresh bucket, and a boto3 client straight to moto."""

    server: S3TestServer
    bucket: str
    client: Any

    @property
    def proxy(self) -> FaultProxy:
        return self.server.proxy

    def url(self, prefix: str = "ckpt") -> str:
        return f"s3://{self.bucket}/{prefix}"

    def get(self, key: str) -> bytes:
        return self.client.get_object(Bucket=self.bucket, Key=key)["Body"].read()

    def keys(self, prefix: str = "") -> dict[str, int]:
        out = {}
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix):
            out.update({o["Key"]: o["Size"] for o in page.get("Contents", [])})
        return out


def steps_log(env: S3Env) -> list[Request]:
    """The requests the proxy saw, less a backend's probe of its conditional requests (`s3/conditions.py`:
    seven requests on two scratch keys, from before its first conditional one, and its listing of them)."""
    with env.proxy._lock:
        return [r for r in env.proxy.log if "/.stagerd-probe-" not in r.key]


@pytest.fixture(scope="session")
def s3_server() -> Any:
    server = S3TestServer()
    yield server
    server.stop()


@pytest.fixture
def s3(s3_server: S3TestServer, monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> Any:
    """Dummy credentials and the proxy endpoint in the AWS environment, a fresh bucket, no faults."""
    for var in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "AWS_RETRY_MODE", "AWS_MAX_ATTEMPTS"):
        monkeypatch.delenv(var, raising=False)
    for var, value in s3_server.aws_env(tmp_path / "aws-absent").items():
        monkeypatch.setenv(var, value)
    if s3_server.proxy.is_down:
        s3_server.up()
    s3_server.proxy.reset()
    client = s3_server.client()
    bucket = f"stagerd-{uuid.uuid4().hex[:12]}"
    client.create_bucket(Bucket=bucket)
    yield S3Env(s3_server, bucket, client)
    s3_server.proxy.reset()
