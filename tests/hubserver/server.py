"""`HubServer`: the Hub test app served by werkzeug on 127.0.0.1, in a background thread.

Test infrastructure only. `down()` closes the listening socket (clients get "connection refused") and
`up()` listens again on the same port, with the same repos: a Hub that is down, then up. `hang()` keeps
listening but answers nothing (or stops mid-answer) until `unhang()`. `on_lfs_body()` runs a callback in
the middle of an LFS upload, e.g. to SIGKILL the uploading process.
"""

from __future__ import annotations

import contextlib
import secrets
import shutil
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

from werkzeug.serving import BaseWSGIServer, WSGIRequestHandler, make_server

from tests.hubserver.app import HubApp, HubConfig, HubStats, LfsBodyHook
from tests.hubserver.faults import Fault, FaultPlan
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
        self._hangs: list[Fault] = []

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

    def hang(self, path: str = "", *, method: str = "*", stall_after: int | None = None) -> Fault:
        """Accept connections but leave every request (matching `method` and the `path` regex) unanswered
        after reading it; with `stall_after=N`, answer for real but stop after N bytes of the body.
        Until `unhang()`."""
        fault = Fault(method, path, times=1 << 62, hang=stall_after is None, stall_after=stall_after)
        with self._lock:
            self._hangs.append(fault)
        return self.faults.add(fault)

    def unhang(self) -> None:
        """Answer again; requests hung so far lose their connection."""
        with self._lock:
            hangs, self._hangs = self._hangs, []
        for fault in hangs:
            self.faults.remove(fault)
        self.faults.release()

    def on_lfs_body(self, after: int, fn: Callable[[], None], *, nth: int = 1) -> LfsBodyHook:
        """Call `fn()` (in the server thread) once the `nth` LFS upload request to get `after` bytes into
        its body has them; the upload is still in flight when it runs."""
        hook = LfsBodyHook(after, fn, nth)
        self.app.lfs_hook = hook
        return hook

    def tamper(self, sha256: str, at: int = 100) -> None:
        """Flip byte `at` of a stored file (named by its sha256) behind the client's back: its LFS object
        and, for a Xet file, the xorb chunk holding that byte too."""
        lfs = self.store.lfs_path(sha256)
        if lfs.exists():
            data = bytearray(lfs.read_bytes())
            data[at] ^= 0xFF
            lfs.write_bytes(bytes(data))
        with self.store.lock:
            xet = {h for repo in self.store.repos.values() for s, (h, _) in repo.xet.items() if s == sha256}
        for file_hash in xet:
            info = self.app.cas.file(file_hash)
            assert info is not None
            self.app.cas.tamper(info, at)

    def down(self) -> None:
        """Stop listening: new connections are refused until `up()`. Hung requests are let go."""
        self.faults.release()
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

    @property
    def cas_url(self) -> str:
        """The CAS the token endpoints hand out: new for each server, as hf_xet keys its cache by it."""
        return f"{self.endpoint}/cas/{self.app.cas_id}"

    def stop(self) -> None:
        """Stop and clean up; with `config.strict`, a request no route served fails the test here."""
        self.down()
        if self._own_root:
            shutil.rmtree(self.root, ignore_errors=True)
        with self.stats.lock:
            unknown = list(self.stats.unknown)
        if unknown and self.config.strict:
            raise AssertionError(f"the Hub test server got requests it does not serve: {unknown[:10]}")

    def __enter__(self) -> HubServer:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is None:
            self.stop()
            return
        with contextlib.suppress(AssertionError):  # the test's own failure says more
            self.stop()
