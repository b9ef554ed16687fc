"""A restore's Xet downloads, run through hf_xet's session API on a session of the restore's own, under the
URL's bounds.

huggingface_hub's `hf_hub_download` reads a Xet file on one process-wide hf_xet session that none of our
timeouts reach: hf_xet's own HTTP client waits up to five minutes for each read and tries each request six
times, so a CAS that stalls (a reconstruction, a xorb range, the read token) holds a restore for half an hour.
On a session of its own hf_xet's client gets the URL's `connect` and `read` timeouts (its read timeout is an
idle bound: a body that stops mid-way ends too) and the URL's attempts per request, so a stalled CAS ends
the download after `attempts` reads of at most `read` seconds each. No watchdog is needed: the call returns
when hf_xet gives up, so no download outlives it.
"""

from __future__ import annotations

import re
import threading
from pathlib import Path
from typing import Any

from stagerd.errors import RestoreError, SinkAuthError, SinkError
from stagerd.sinks.hub.errors import _XET_HTTP, auth_hint, restore_retry_hint
from stagerd.sinks.hub.timeouts import HubTimeouts
from stagerd.sinks.hub.xet import session_config

# reqwest's texts, as hf_xet passes them on: a request that got no answer in time (or no connection), and
# an answer whose body stopped. hf_xet files the second under "Format error", but it is the wire's.
_XET_UNANSWERED = re.compile(r"error sending request|error decoding response body|timed out")


def download_config(timeouts: HubTimeouts, attempts: int) -> dict[str, Any]:
    """hf_xet settings for a restore: the sink's bounds, each request tried `attempts` times in all."""
    return {**session_config(timeouts), "client.retry_max_attempts": max(0, attempts - 1)}


class XetDownloader:
    """One restore's hf_xet session (made on first use) and the download of one Xet file of its commit."""

    def __init__(
        self, timeouts: HubTimeouts, attempts: int, *, endpoint: str, repo_id: str, commit: str, headers: dict
    ) -> None:
        from huggingface_hub.utils._xet import XetTokenType, xet_connection_info_refresh_url

        self.timeouts, self.attempts, self.repo_id = timeouts, attempts, repo_id
        self._refresh_url = xet_connection_info_refresh_url(
            token_type=XetTokenType.READ,
            repo_id=repo_id,
            repo_type="model",
            revision=commit,
            endpoint=endpoint,
        )
        self._headers = headers  # with the Hub token, for the token route only
        self._cas_headers = {k: v for k, v in headers.items() if k.lower() != "authorization"}
        self._session: Any = None
        self._lock = threading.Lock()

    def _get_session(self) -> Any:
        from hf_xet import XetConfig, XetSession  # type: ignore[import-untyped]

        with self._lock:
            if self._session is None:
                config = download_config(self.timeouts, self.attempts)
                self._session = XetSession(config=XetConfig().with_config(config))
            return self._session

    def download(self, xet_hash: str, size: int, dest: Path, path: str) -> None:
        """Write the file `xet_hash` (`size` bytes) to `dest`; a failure is a named error naming `path`."""
        from hf_xet import XetFileInfo

        dest.parent.mkdir(parents=True, exist_ok=True)
        try:
            with self._get_session().new_file_download_group(
                token_refresh_url=self._refresh_url,
                token_refresh_headers=self._headers,
                custom_headers=self._cas_headers,
            ) as group:
                group.start_download_file(XetFileInfo(xet_hash, size), str(dest))
        except (RuntimeError, OSError) as err:  # hf_xet's own (its auth and not-found errors are OSErrors)
            raise self.error(err, path) from None

    def error(self, err: BaseException, path: str) -> Exception:
        """hf_xet's failure as a named error (see `xet_download_error`), with this restore's bounds."""
        return xet_download_error(err, path, self.timeouts, self.attempts, repo_id=self.repo_id)


def xet_download_error(
    err: BaseException,
    path: str,
    timeouts: HubTimeouts | None = None,
    attempts: int | None = None,
    *,
    repo_id: str = "the repo",
) -> Exception:
    """A failed Xet download as a named error: an HTTP failure of the CAS, or a request it left unanswered
    (after hf_xet's own retries), is a retryable `SinkError` (`SinkAuthError` for 401/403); anything else is
    stored data that does not rebuild."""
    text = str(err)
    denied, again = auth_hint(repo_id, write=False), restore_retry_hint(repo_id)
    if type(err).__name__ == "XetAuthenticationError":
        return SinkAuthError("Xet storage refused the token", path=path, hint=denied)
    if type(err).__name__ == "XetObjectNotFoundError":
        return RestoreError("is listed in the Hub's tree but not in its Xet storage", path=path)
    if _XET_UNANSWERED.search(text) is not None:
        within = "in time" if timeouts is None else f"within {timeouts.read:g} s"
        tries = "" if attempts is None else f", {attempts} attempt{'s' if attempts != 1 else ''}"
        said = f"download failed: Xet storage did not answer {within}{tries}"
        return SinkError(said, path=path, hint=again)
    m = _XET_HTTP.search(text)
    if m is None:
        return RestoreError(f"cannot be rebuilt from Xet storage: {err}", path=path)
    status = int(m.group(1))
    if status in (401, 403):
        return SinkAuthError(f"Xet storage refused the token ({status})", path=path, hint=denied)
    return SinkError(f"download failed: HTTP {status} from Xet storage", path=path, hint=again)
