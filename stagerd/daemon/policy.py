"""The retry policy: how long to back off after a failure, and when to give up and quarantine."""

from __future__ import annotations

from dataclasses import dataclass

from stagerd.config import Settings
from stagerd.errors import StagerdError


@dataclass(frozen=True)
class Failure:
    """What to record for a failed attempt: retry at `next_try`, or quarantine."""

    error_class: str
    message: str
    quarantine: bool
    next_try: float | None


def backoff_delay(attempts: int, settings: Settings) -> float:
    """Seconds to wait after the `attempts`-th failure: doubling from `retry_base_seconds`, capped."""
    return min(settings.retry_max_seconds, settings.retry_base_seconds * 2 ** (attempts - 1))


def decide_failure(err: BaseException, attempts: int, settings: Settings, now: float) -> Failure:
    """Pure retry policy: non-retryable errors quarantine at once; others back off until attempts run out."""
    if isinstance(err, StagerdError):
        retryable, cls, msg = err.retryable, err.name, str(err)
    else:  # an unexpected exception: a bug or an unwrapped OSError; retrying is the safe default
        retryable, cls, msg = True, type(err).__name__, str(err) or repr(err)
    if not retryable or attempts >= settings.max_attempts:
        return Failure(cls, msg, True, None)
    return Failure(cls, msg, False, now + backoff_delay(attempts, settings))
