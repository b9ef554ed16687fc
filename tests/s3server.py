"""A real S3 endpoint for the tests: moto's `ThreadedMotoServer` on 127.0.0.1, behind a fault-injecting proxy.

The proxy (`tests/s3proxy.py`) is a small threaded WSGI server (werkzeug) that forwards every request to
moto over HTTP, and on the way:
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

Fixtures: `s3_server` (session: a proxy of the module's own, before the test process's one moto) and `s3`
(per test: faults cleared, log cleared, dummy credentials in the environment, a fresh bucket). Import both
into a test module to use them.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from werkzeug.serving import BaseWSGIServer, WSGIRequestHandler, make_server

from tests.s3proxy import ACCESS_KEY, IGNORE_ALL, REGION, SECRET_KEY, Fault, FaultProxy, Request

__all__ = [
    "ACCESS_KEY",
    "IGNORE_ALL",
    "SECRET_KEY",
    "Fault",
    "FaultProxy",
    "Request",
    "S3Env",
    "S3TestServer",
]


class _QuietHandler(WSGIRequestHandler):
    def log_request(self, *args: Any, **kwargs: Any) -> None:
        pass

    def log_error(self, *args: Any) -> None:
        pass


def start_moto() -> Any:
    """moto's ThreadedMotoServer on a free 127.0.0.1 port."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto logs every request otherwise
    moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    moto.start()
    return moto


class S3TestServer:
    """moto's ThreadedMotoServer on a free 127.0.0.1 port (its own, or `moto`), and the fault proxy on
    another: a proxy of its own, whose log and faults only its clients see."""

    def __init__(self, moto: Any = None) -> None:
        self._owns_moto = moto is None
        self.moto = start_moto() if moto is None else moto
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
        # polled often, so that `down()` (an outage, or the end of the fixture) takes no half second
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
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
        if self._owns_moto:
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


# One moto per test process, behind a proxy per module. Each test module imports the fixture below, and
# pytest takes an imported fixture for a definition of that module: every module that uses it gets a server
# of its own, kept to the session's end. Its proxy (its request log and faults) stays the module's own, so
# a request a test of another module left in flight is never counted here; moto (half a second to start,
# as long to stop), which every test reaches through a fresh bucket of its own, is started once.
_moto: list[Any] = []
_users = [0]


@pytest.fixture(scope="session")
def s3_server() -> Any:
    if not _moto:
        _moto.append(start_moto())
    _users[0] += 1
    server = S3TestServer(moto=_moto[0])
    yield server
    server.stop()
    _users[0] -= 1
    if not _users[0]:
        _moto.pop().stop()


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
