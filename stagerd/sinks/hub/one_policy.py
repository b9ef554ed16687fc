"""The sink's retry policy as the only one on its requests.

huggingface_hub retries some calls itself (a tree or history page, the upload modes, an LFS batch: its
`http_backoff`), under none of the sink's bounds: a 408, 429 or 5xx answer, a timeout or a dropped connection
is tried five more times, each 429 slept out for its Retry-After and a second more, each other failure after a
backoff of 1 to 8 s. So a publish that `max_retry_after` should end at once waited five times the Hub's
Retry-After first, one unanswered tree page held an attempt for six read timeouts and 23 s more, and
`max_attempts` counted one request in six. Within `sink_policy_only()`, such a failure of a Hub API request
(`/api/...`) of this thread (a sink's publish, a restore) is raised at once to the sink's retries: an answer
as huggingface_hub's own error, a transport failure as `Unretried`, whose cause is httpx's error. The LFS
transfer keeps huggingface_hub's retries: a part answered 503 is sent again, not the whole file by the sink's
next attempt. Elsewhere in the process (another thread, a trainer's own Hub calls) huggingface_hub retries as
it always does.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from stagerd.sinks.hub.http_lib import httpx

# the answers huggingface_hub's `http_backoff` tries again
RETRIED_STATUS = frozenset({408, 429, 500, 502, 503, 504})
_ACTIVE: ContextVar[bool] = ContextVar("stagerd_hub_sink_policy_only", default=False)


def _applies(request: httpx.Request) -> bool:
    return _ACTIVE.get() and "/api/" in request.url.path


class Unretried(Exception):
    """A sink's request that failed in transport (its cause), raised past huggingface_hub's retries."""


@contextmanager
def sink_policy_only() -> Iterator[None]:
    """Within: this thread's huggingface_hub requests are not retried by huggingface_hub."""
    token = _ACTIVE.set(True)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def attach(client: httpx.Client) -> None:
    """Make `client` (huggingface_hub's shared one) raise a sink's failed requests past its retries."""
    from stagerd.sinks.hub.http_lib import httpx

    retried = (httpx.TimeoutException, httpx.NetworkError, httpx.RemoteProtocolError)
    send = client.send

    def send_once(request: httpx.Request, **kwargs: Any) -> httpx.Response:
        try:
            return send(request, **kwargs)
        except retried as e:
            if not _applies(request):
                raise
            raise Unretried(f"{type(e).__name__} on {request.method} {request.url.path}") from e

    client.send = send_once  # type: ignore[method-assign]
    client.event_hooks["response"].append(_raise_retried_answer)


def _raise_retried_answer(response: httpx.Response) -> None:
    """httpx response hook: inside `sink_policy_only`, a retried answer of the Hub API becomes
    huggingface_hub's error."""
    if response.status_code not in RETRIED_STATUS or not _applies(response.request):
        return
    from huggingface_hub.utils import hf_raise_for_status

    response.read()  # the hook runs before the body is read; the error names the Hub's message
    hf_raise_for_status(response)
