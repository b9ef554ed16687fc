"""The Xet upload of a step, run by the sink itself through hf_xet's session API, under the sink's bounds.

huggingface_hub uploads through Xet whenever hf_xet is installed (and `HF_HUB_DISABLE_XET` is not set), but
inside `create_commit` on one process-wide session: no timeout of ours reaches hf_xet's own HTTP client (it
retries for up to six minutes, and uploads shards with no read timeout at all), and what went over the wire
is not reported. So the sink uploads the files itself, the way huggingface_hub's own upload pipeline does
(an hf_xet upload commit, then the operations marked uploaded and committed), on a session of its own:

- hf_xet's client gets the sink's `connect` and `read` timeouts, and a retry budget of one `read` timeout
  per request;
- a watchdog gives up on the upload (aborting it) once hf_xet reports no progress for `read + connect`
  seconds: a stalled CAS, including a stalled shard upload, ends the attempt as a retryable
  `XetStalled`;
- the bytes sent are hf_xet's own count of xorb and shard bytes uploaded.
"""

from __future__ import annotations

import importlib.util
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from stagerd.sinks.hub.timeouts import HubTimeouts

log = logging.getLogger("stagerd.sinks.hub")


def xet_enabled() -> bool:
    """huggingface_hub's own rule: Xet when hf_xet is installed, unless `HF_HUB_DISABLE_XET` is set."""
    from huggingface_hub import constants

    return not constants.HF_HUB_DISABLE_XET and importlib.util.find_spec("hf_xet") is not None


class XetStalled(TimeoutError):
    """The Xet upload made no progress for too long and was abandoned; retryable."""


@dataclass(frozen=True)
class XetFile:
    source: str | bytes  # a path on disk, or the content
    sha256: str  # hex, known from the export scan: hf_xet then does not hash the file again


def session_config(timeouts: HubTimeouts) -> dict[str, Any]:
    """hf_xet settings for a sink's bounds (the rest stay hf_xet's defaults)."""
    return {
        "client.connect_timeout": timedelta(seconds=timeouts.connect),
        "client.read_timeout": timedelta(seconds=timeouts.read),
        "client.retry_max_duration": timedelta(seconds=timeouts.read),
        "client.retry_base_delay": timedelta(seconds=min(3.0, timeouts.read / 10)),
    }


class XetUploader:
    """One sink's hf_xet session (made on first use) and the bounded upload of a set of files."""

    def __init__(self, timeouts: HubTimeouts) -> None:
        self.timeouts = timeouts
        self._session: Any = None
        self._lock = threading.Lock()

    def _get_session(self) -> Any:
        from hf_xet import XetConfig, XetSession  # type: ignore[import-untyped]

        with self._lock:
            if self._session is None:
                self._session = XetSession(config=XetConfig().with_config(session_config(self.timeouts)))
            return self._session

    def upload(
        self,
        files: Sequence[XetFile],
        *,
        token_refresh_url: str,
        headers: dict[str, str],
        progress: Callable[[int], None] | None = None,
    ) -> int:
        """Upload `files` (chunked, deduplicated, xorbs then the shard); returns the bytes sent.

        `headers` are the Hub request headers (with the Hub token) for the token route; the CAS gets them
        without the Hub token. `progress(n)` is told the bytes of `files` processed so far.
        """
        if not files:
            return 0
        session = self._get_session()
        watch = _Watch(progress)
        cas_headers = {k: v for k, v in headers.items() if k.lower() != "authorization"}
        outcome: dict[str, Any] = {}
        # An upload given up on before it had a commit to abort must never start later: its paths may be
        # read through a step handle the daemon closes once this call returns.
        given_up = threading.Event()
        handover = threading.Lock()

        def finish() -> None:
            try:
                # Getting the CAS token is a request too: inside the watched thread.
                commit = session.new_upload_commit(
                    token_refresh_url=token_refresh_url,
                    token_refresh_headers=headers,
                    custom_headers=cas_headers,
                    progress_callback=watch.update,
                )
                with handover:
                    if given_up.is_set():
                        commit.abort()
                        return
                    outcome["commit"] = commit
                    for f in files:
                        if isinstance(f.source, bytes):
                            commit.start_upload_bytes(f.source, sha256=f.sha256)
                        else:
                            commit.start_upload_file(f.source, sha256=f.sha256)
                outcome["report"] = commit.wait_to_finish()
            except BaseException as e:  # handed to the caller's thread below
                outcome["error"] = e

        worker = threading.Thread(target=finish, name="stagerd-xet-upload", daemon=True)
        worker.start()
        limit = self.timeouts.read + self.timeouts.connect
        while worker.is_alive():
            worker.join(min(0.25, limit / 4))
            if worker.is_alive() and watch.idle() > limit:
                log.warning("Xet upload: no progress for %.0f s; abandoning it", watch.idle())
                with handover:
                    given_up.set()  # still getting its CAS token: it aborts once it has one
                if "commit" in outcome:
                    outcome["commit"].abort()
                    worker.join(min(1.0, limit))  # let it unwind; a worker that does not is left behind
                raise XetStalled(
                    f"the Hub's Xet storage did not answer within {limit:g} s "
                    f"(no upload progress; {watch.describe()})"
                )
        if "error" in outcome:
            raise outcome["error"]
        metrics = outcome["report"].dedup_metrics
        return int(metrics.xorb_bytes_uploaded) + int(metrics.shard_bytes_uploaded)

    def close(self) -> None:
        with self._lock:
            self._session = None


class _Watch:
    """hf_xet's progress callback: when anything last moved, and the bytes processed so far."""

    def __init__(self, progress: Callable[[int], None] | None) -> None:
        self._progress = progress
        self._last: tuple[int, ...] = ()
        self._moved = time.monotonic()
        self._lock = threading.Lock()

    def update(self, report: Any, _items: Any) -> None:
        shard = report.shard
        now = (
            report.total_bytes_completed,
            report.total_transfer_bytes_completed,
            *(() if shard is None else (shard.total_shard_bytes_upload_completed, shard.total_shards_synced)),
        )
        with self._lock:
            if now != self._last:
                self._last, self._moved = now, time.monotonic()
        if self._progress is not None:
            try:
                self._progress(int(report.total_bytes_completed))
            except Exception:  # a progress display must not break hf_xet's callback thread
                log.debug("progress callback failed", exc_info=True)

    def idle(self) -> float:
        with self._lock:
            return time.monotonic() - self._moved

    def describe(self) -> str:
        with self._lock:
            last = self._last
        if not last:
            return "nothing processed"
        return f"{last[0]} bytes processed, {last[1]} sent"
