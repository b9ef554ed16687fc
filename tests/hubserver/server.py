"""`HubServer`: the Hub test app served by werkzeug on 127.0.0.1, in a background thread.

Test infrastructure only. `down()` closes the listening socket (clients get "connection refused") and
`up()` listens again on the same port, with the same repos: a Hub that is down, then up.
"""

from __future__ import annotations

import secrets
import shutil
import tempfile
import threading
from pathlib import Path
from types import TracebackType

from werkzeug.serving import BaseWSGIServer, WSGIRequestHandler, make_server

from tests.hubserver.app import HubApp, HubConfig, HubStats
from tests.hubserver.faults import FaultPlan
from tests.hubserver.store import HubStore


class _QuietHandler(WSGIRequestHandler):
    """No access log on stderr: the app records every request in `HubStats`."""

    def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
        pass


class HubServer:
    """A Hub-protocol server for tests. Use as a context manager; `endpoint` is its base URL.

    `token` is a write token for user `user`; `read_token` can read but not write. Every other token
    gets a 401. LFS objects are kept under `root` (a temp dir by default, removed on stop).
    """

    def __init__(
        self,
        root: str | Path | None = None,
        *,
        config: HubConfig | None = None,
        user: str = "stagerd-test",
        host: str = "127.0.0.1",
    ) -> None:
        self._own_root = root is None
        self.root = Path(tempfile.mkdtemp(prefix="hubserver-")) if root is None else Path(root)
        self.user = user
        self.token = "hf_" + secrets.token_hex(16)
        self.read_token = "hf_" + secrets.token_hex(16)
        self.config = config or HubConfig()
        self.store = HubStore(self.root / "lfs")
        self.faults = FaultPlan()
        tokens = {self.token: (user, "write"), self.read_token: (user, "read")}
        self.app = HubApp(self.store, self.faults, tokens, self.config)
        self.host = host
        self.port = 0
        self._server: BaseWSGIServer | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def stats(self) -> HubStats:
        return self.app.stats

    def start(self) -> HubServer:
        self.up()
        return self

    def up(self) -> None:
        """Listen (again); on restart the port and all content are kept."""
        with self._lock:
            if self._server is not None:
                return
            server = make_server(self.host, self.port, self.app, threaded=True, request_handler=_QuietHandler)
            self.port = server.port
            thread = threading.Thread(
                target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
            )
            thread.start()
            self._server, self._thread = server, thread

    def down(self) -> None:
        """Stop listening: new connections are refused until `up()`."""
        with self._lock:
            server, thread = self._server, self._thread
            self._server = self._thread = None
        if server is not None:
            server.shutdown()
            server.server_close()
        if thread is not None:
            thread.join(timeout=5)

    def down_for(self, seconds: float) -> threading.Timer:
        """Go down now and come back up after `seconds`, in the background."""
        self.down()
        timer = threading.Timer(seconds, self.up)
        timer.daemon = True
        timer.start()
        return timer

    def stop(self) -> None:
        self.down()
        if self._own_root:
            shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> HubServer:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
