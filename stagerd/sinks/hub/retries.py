"""One Hub call under the sink's retry policy: auth refusals and fatal errors raised at once as named errors,
the rest retried with backoff (or after the Hub's Retry-After), no token in any message."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from stagerd.errors import SinkAuthError, SinkError, StagerdError
from stagerd.sinks.hub.errors import _TOKEN_RE, HubFailure, auth_hint, classify
from stagerd.sinks.hub.one_policy import sink_policy_only
from stagerd.sinks.hub.url import RetryPolicy, T

log = logging.getLogger("stagerd.sinks.hub")


def redact(text: str, token: str | None) -> str:
    if token:
        text = text.replace(token, "***")
    return _TOKEN_RE.sub("***", text)


def tried(
    fn: Callable[[], T],
    retry: RetryPolicy,
    *,
    where: str,
    token: str | None,
    answers: tuple[type[BaseException], ...] = (),
    give_up: Callable[[HubFailure, int, float], None] | None = None,
    extra: dict[str, object] | None = None,
) -> T:
    """`fn()`, tried again on what `classify` says the sink retries (a 5xx, a 429, a dropped connection),
    with backoff or after the Hub's Retry-After, up to `retry.max_attempts`. Any other failure, or the
    last, goes to `give_up(failure, attempt, delay)` (which may raise a named error) and is otherwise
    raised as it came; `answers` (a missing repo, say) and stagerd's own errors are raised at once. `where`
    names the call in the log, with no token in any message. huggingface_hub retries none of `fn`'s Hub API
    requests itself (`one_policy.py`): each failed one is one of these attempts."""
    attempt = 0
    while True:
        attempt += 1
        try:
            with sink_policy_only():
                return fn()
        except StagerdError:
            raise
        except answers:
            raise
        except Exception as exc:
            failure = classify(exc)
            delay = failure.retry_after if failure.retry_after is not None else retry.delay(attempt)
            if failure.kind != "retry" or attempt >= retry.max_attempts or delay > retry.max_retry_after:
                if give_up is not None:
                    give_up(failure, attempt, delay)
                raise
            log.warning(
                "%s: attempt %d/%d failed (%s); retrying in %.2f s",
                where,
                attempt,
                retry.max_attempts,
                redact(failure.text, token),
                delay,
                extra=None if extra is None else {**extra, "attempt": attempt},
            )
            time.sleep(delay)


def with_retries(
    fn: Callable[[], T], retry: RetryPolicy, *, sink: str, step: int, repo_id: str, token: str | None
) -> T:
    """`fn()`, tried up to `retry.max_attempts` times; `sink` is the redacted URL the messages name. What
    is not retried, or is no longer, is a named error."""
    where = f"{sink}: step {step}"

    def give_up(failure: HubFailure, attempt: int, delay: float) -> None:
        text = redact(failure.text, token)
        if failure.kind == "auth":
            raise SinkAuthError(
                f"{where}: the Hub refused the request ({text})",
                hint=auth_hint(repo_id, write=True),
            ) from None
        if failure.kind == "fatal":
            raise SinkError(f"{where}: {text}") from None
        if attempt >= retry.max_attempts:
            raise SinkError(f"{where}: gave up after {attempt} attempts: {text}") from None
        raise SinkError(f"{where}: rate limited for {delay:.0f} s: {text}") from None

    return tried(fn, retry, where=where, token=token, give_up=give_up, extra={"sink": sink, "step": step})
