"""The sink's retry policy as the only one on its requests.

huggingface_hub retries a 408, 429 or 5xx answer itself inside some calls (a tree or history page, the
upload modes, an LFS batch: its `http_backoff`, five more tries, each 429 slept out for its Retry-After and
a second more), under none of the sink's bounds: a publish that `max_retry_after` should end at once waited
five times the Hub's Retry-After first, and `max_attempts` counted one request in six. Within
`sink_policy_only()`, such an answer to a request of this thread is raised at once, as huggingface_hub's
own error, to the sink's retries. Elsewhere in the process (another thread, a trainer's own Hub calls)
huggingface_hub retries as it always does.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import httpx2

# the answers huggingface_hub's `http_backoff` tries again
RETRIED_STATUS = frozenset({408, 429, 500, 502, 503, 504})
_ACTIVE: ContextVar[bool] = ContextVar("stagerd_hub_sink_policy_only", default=False)


@contextmanager
def sink_policy_only() -> Iterator[None]:
    """Within: a retried answer to this thread's huggingface_hub requests is raised, not retried."""
    token = _ACTIVE.set(True)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def raise_retried_answer(response: httpx2.Response) -> None:
    """httpx response hook: inside `sink_policy_only`, a retried answer becomes huggingface_hub's error."""
    if not _ACTIVE.get() or response.status_code not in RETRIED_STATUS:
        return
    from huggingface_hub.utils import hf_raise_for_status

    response.read()  # the hook runs before the body is read; the error names the Hub's message
    hf_raise_for_status(response)
