"""Hub failures, classified: auth errors at once, 429 after Retry-After, 5xx and timeouts retried, no token
in any message."""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from email.utils import parsedate_to_datetime
from typing import TYPE_CHECKING, Literal
from urllib.parse import urlsplit

from stagerd.errors import ConfigError

if TYPE_CHECKING:
    from stagerd.sinks.hub.http_lib import httpx


def refuse_offline(where: str) -> None:
    """A `ConfigError` where huggingface_hub is in offline mode: it refuses every request for the life of
    the process (read once, at import), so each retry would fail alike, as an outage that never ends."""
    from huggingface_hub import constants

    if not constants.HF_HUB_OFFLINE:
        return
    name = "HF_HUB_OFFLINE" if os.environ.get("HF_HUB_OFFLINE") else "TRANSFORMERS_OFFLINE"
    raise ConfigError(
        f"huggingface_hub is in offline mode ({name}={os.environ.get(name, '')}): it sends no Hub request",
        path=where,
        hint=f"unset {name} in stagerd's environment (the trainer may keep it), then run stagerd again",
    )


def auth_hint(repo_id: str, *, write: bool) -> str:
    """What to do about a Hub that refused the token: the Hub's own credentials only."""
    can = "write to" if write else "read"
    return (
        f"check HF_TOKEN (or ?token= in the URL, or `hf auth login`) and that the token can {can} {repo_id}; "
        "a repo the token cannot see answers 404"
    )


def restore_retry_hint(repo_id: str) -> str:
    """What to do about a restore that gave up on a Hub that failed or did not answer: unlike the daemon,
    nothing tries it again."""
    return (
        f"nothing was restored; check the network and the Hub endpoint (HF_ENDPOINT or ?endpoint=) and that "
        f"{repo_id} is reachable, then run the restore again; add ?max_attempts=N to the URL (default 3) "
        "where the link is flaky"
    )


# --- errors ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class HubFailure:
    """How a failed call is handled: `auth` (raise now), `retry` (backoff or Retry-After), `fatal`."""

    kind: Literal["auth", "retry", "fatal"]
    text: str
    retry_after: float | None = None


def _chain(exc: BaseException) -> Iterable[BaseException]:
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        yield cur
        cur = cur.__cause__ or cur.__context__


def _retry_after(headers: Mapping[str, str]) -> float | None:
    from huggingface_hub.utils import parse_ratelimit_headers

    info = parse_ratelimit_headers(headers)
    if info is not None and info.remaining == 0:
        return float(info.reset_in_seconds)
    value = headers.get("retry-after")
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        return max(0.0, parsedate_to_datetime(value).timestamp() - time.time())
    except (TypeError, ValueError):
        return None


# hf_xet reports an HTTP failure (after its own retries) as a ConnectionError whose text names the status
# and the URL: "... HTTP status server error (503 SERVICE UNAVAILABLE), domain: http://host/path".
_XET_HTTP = re.compile(r"HTTP status (?:client|server) error \((\d{3})[^)]*\)(?:, domain: (\S+))?")


def _xet_failure(e: BaseException) -> HubFailure | None:
    """How a failure of the Xet upload (hf_xet's, or the sink's watchdog) is handled; None if not one."""
    from stagerd.sinks.hub.xet import XetStalled

    if isinstance(e, XetStalled):
        return HubFailure("retry", str(e))
    if type(e).__name__ == "XetAuthenticationError":
        return HubFailure("auth", f"Xet storage refused the token: {e}")
    m = _XET_HTTP.search(str(e)) if isinstance(e, ConnectionError) else None
    if m is None:
        return None
    status = int(m.group(1))
    where = urlsplit(m.group(2)).path if m.group(2) else "Xet storage"
    text = f"HTTP {status} from Xet storage on {where}"
    if status in (401, 403):
        return HubFailure("auth", text)
    if status in (408, 409, 423, 429) or status >= 500:
        return HubFailure("retry", text)
    return HubFailure("fatal", text)


def classify(exc: BaseException) -> HubFailure:
    """Map an exception from huggingface_hub/httpx/hf_xet (possibly wrapped) to how the sink handles it."""
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError

    from stagerd.sinks.hub.http_lib import httpx

    for e in _chain(exc):
        if (xet := _xet_failure(e)) is not None:
            return xet
        if isinstance(e, HfHubHTTPError) and e.response is not None:
            response = e.response
            status = response.status_code
            request = response.request
            where = f"{request.method} {request.url.path}" if request is not None else "request"
            detail = (e.server_message or str(e).splitlines()[0]).strip().replace("\n", "; ")
            text = f"HTTP {status} on {where}: {detail}"
            if status in (401, 403) or isinstance(e, RepositoryNotFoundError | GatedRepoError):
                return HubFailure("auth", text)
            if status == 429:
                return HubFailure("retry", text, _retry_after(response.headers))
            if (
                status in (408, 409, 412, 423)
                or status >= 500
                or e.response.headers.get("X-Error-Code") in ("RevisionNotFound",)
            ):
                return HubFailure("retry", text)
            return HubFailure("fatal", text)
        if isinstance(e, httpx.TimeoutException):
            return HubFailure("retry", _timeout_text(e))
        if isinstance(e, httpx.TransportError | ConnectionError | TimeoutError):
            return HubFailure("retry", f"connection failed: {type(e).__name__}: {e}")
    return HubFailure("fatal", f"{type(exc).__name__}: {exc}")


def _timeout_text(exc: httpx.TimeoutException) -> str:
    """'the Hub did not answer within N s (read timeout on METHOD /path)'; the path only, never a query."""
    from stagerd.sinks.hub.http_lib import httpx

    kinds = {httpx.ConnectTimeout: "connect", httpx.WriteTimeout: "write", httpx.PoolTimeout: "pool"}
    kind = kinds.get(type(exc), "read")
    what = "accept the connection" if kind == "connect" else "answer"
    try:
        request = exc.request
    except RuntimeError:  # raised by httpx when no request is attached
        return f"the Hub did not {what} in time ({kind} timeout)"
    seconds = (request.extensions.get("timeout") or {}).get(kind)
    within = "in time" if seconds is None else f"within {seconds:g} s"
    return f"the Hub did not {what} {within} ({kind} timeout on {request.method} {request.url.path})"


# what a message or card may hold: a user access token, an OAuth one (`hf_oauth_...`), a bearer credential
_TOKEN_RE = re.compile(r"(hf_(?:oauth_)?[A-Za-z0-9]{6,}|(?i:bearer)\s+\S+)")
