"""One Hub call under the sink's retry policy: auth refusals and fatal errors raised at once as named errors,
the rest retried with backoff (or after the Hub's Retry-After), no token in any message."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from stagerd.errors import SinkAuthError, SinkError, StagerdError
from stagerd.sinks.hub.errors import _TOKEN_RE, classify
from stagerd.sinks.hub.url import RetryPolicy, T

log = logging.getLogger("stagerd.sinks.hub")


def redact(text: str, token: str | None) -> str:
    if token:
        text = text.replace(token, "***")
    return _TOKEN_RE.sub("***", text)


def with_retries(
    fn: Callable[[], T], retry: RetryPolicy, *, sink: str, step: int, repo_id: str, token: str | None
) -> T:
    """`fn()`, tried up to `retry.max_attempts` times; `sink` is the redacted URL the messages name."""
    attempt = 0
    while True:
        attempt += 1
        try:
            return fn()
        except StagerdError:
            raise
        except Exception as exc:
            failure = classify(exc)
            text = redact(failure.text, token)
            where = f"{sink}: step {step}"
            if failure.kind == "auth":
                raise SinkAuthError(
                    f"{where}: the Hub refused the request ({text})",
                    hint=f"check HF_TOKEN (or `hf auth login`) and that the token can write to "
                    f"{repo_id}; a repo the token cannot see answers 404",
                ) from None
            if failure.kind == "fatal":
                raise SinkError(f"{where}: {text}") from None
            if attempt >= retry.max_attempts:
                raise SinkError(f"{where}: gave up after {attempt} attempts: {text}") from None
            delay = failure.retry_after if failure.retry_after is not None else retry.delay(attempt)
            if delay > retry.max_retry_after:
                raise SinkError(f"{where}: rate limited for {delay:.0f} s: {text}") from None
            log.warning(
                "%s: attempt %d/%d failed (%s); retrying in %.2f s",
                where,
                attempt,
                retry.max_attempts,
                text,
                delay,
                extra={"sink": sink, "step": step, "attempt": attempt},
            )
            time.sleep(delay)
