"""The retry policy: how long to back off after a failure, and when to give up and quarantine."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from stagerd import errors
from stagerd.config import Settings
from stagerd.daemon.journal.schema import FAILED, QUARANTINED
from stagerd.errors import FleetWaitError, SinkAuthError, SinkMissingError, StagerdError
from stagerd.sinks.urls import SinkKind, parse_sink_url

# A Hub or S3 sink's own tries of each request in a `--once` run, where the user sets none: the run's own
# tries of the sink (`max_attempts`, with backoff) ride out an outage; the sinks' defaults (the Hub's 8,
# backing off to 60 s; botocore's 5, to 8 s) made every one of them last long, and the two multiply.
ONCE_SINK_ATTEMPTS = 3

# Quarantines the daemon records itself, which no wait or restart fixes by itself.
_NEVER_RETRYABLE = {"CrashLoop", "MissingStep"}

# A publish to a sink that needs a person (a bucket to create, a token or permission to fix): nothing is
# wrong with the step, so it waits, checked again every `retry_max_seconds` and at each start, instead of
# a quarantine that only `stagerd retry` lifted, step by step, after the fix.
_WAITS_FOR_A_FIX = (SinkMissingError, SinkAuthError)


@dataclass(frozen=True)
class Failure:
    """What to record for a failed attempt: retry at `next_try`, wait with none, or quarantine."""

    error_class: str
    message: str
    quarantine: bool
    next_try: float | None
    # a `--once` run's last try of what may pass: the next start tries it again (a publish's lane waits,
    # failed with no next try; an export is quarantined, re-armed at start as `given_up` reads its row)
    given_up: bool = False
    # a sink that waits for a person's fix (`_WAITS_FOR_A_FIX`): logged as an error, though not quarantined
    needs_fix: bool = False


def backoff_delay(attempts: int, settings: Settings) -> float:
    """Seconds to wait after the `attempts`-th failure: doubling from `retry_base_seconds`, capped."""
    return min(settings.retry_max_seconds, settings.retry_base_seconds * 2 ** (attempts - 1))


def decide_failure(
    err: BaseException, attempts: int, settings: Settings, now: float, *, publish: bool = False
) -> Failure:
    """Pure retry policy. A failure that cannot pass by waiting quarantines at once. One that may pass
    backs off, doubling up to `retry_max_seconds`: forever in a running daemon (a sink outage of any
    length heals by itself), and for `max_attempts` tries in a `--once` run, which must end; the next
    start then tries again. A `publish` given up so is left waiting, failed with no next try, never
    quarantined: the step is fine and its sink was down, as a sink whose bucket is missing leaves it;
    calling it quarantined sent users to `stagerd retry` for nothing. An export given up so is
    quarantined, and re-armed at the next start (`rearmable`).

    A fleet step's wait for other nodes that timed out in a `--once` run is given up for this run at once
    (the wait was the setting; waiting again changes nothing) but never quarantined: failed with no next
    try, the step still waits, and the next start tries it again. So is a publish to a sink that waits for
    a person's fix, which a running daemon checks again only every `retry_max_seconds`: a destination that
    is missing (`SinkMissingError`), a token refused or a permission lacking (`SinkAuthError`). The step
    is fine, and waits for the bucket to be created or the credentials fixed."""
    if isinstance(err, FleetWaitError) and settings.once:
        return Failure(err.name, str(err), False, None)
    if isinstance(err, _WAITS_FOR_A_FIX):
        next_try = None if settings.once else now + settings.retry_max_seconds
        return Failure(err.name, str(err), False, next_try, needs_fix=True)
    if isinstance(err, StagerdError):
        retryable, cls, msg = err.retryable, err.name, str(err)
    else:  # an unexpected exception: a bug or an unwrapped OSError; retrying is the safe default
        retryable, cls, msg = True, type(err).__name__, str(err) or repr(err)
    if not retryable:
        return Failure(cls, msg, True, None)
    if settings.once and attempts >= settings.max_attempts:
        return Failure(cls, msg, not publish, None, given_up=True)
    return Failure(cls, msg, False, now + backoff_delay(attempts, settings))


def sink_outage(f: Failure) -> bool:
    """Whether a publish's failure counts as one of its sink's failed tries in a row: what is retried or
    given up for a `--once` run may be the sink being down. What is quarantined for good was an answer
    about the step (a conflict, a refusal), and a sink that waits for a fix (`_WAITS_FOR_A_FIX`) or a
    fleet wait has its own rule."""
    return f.next_try is not None or f.given_up


def gives_up_sink(f: Failure, settings: Settings) -> bool:
    """Whether a publish's failure, decided with the sink's tries in a row as its `attempts`, ends a
    `--once` run's tries of that sink: it ran out of tries on what may pass, so the sink is down for this
    run and its other steps are left for the next start (`SinkDownError`), not each tried `max_attempts`
    times more. A running daemon never gives up a sink."""
    return settings.once and f.given_up


def once_sink_options(url: str) -> dict[str, Any]:
    """The options a `--once` run opens the sink at `url` with: a Hub or S3 sink's own tries of each
    request (`ONCE_SINK_ATTEMPTS`), unless the Hub URL sets `max_attempts` (or, for S3, the AWS
    environment or config file sets the client's retries: the sink checks); none for other sinks."""
    kind = parse_sink_url(url).kind
    if kind is SinkKind.S3:
        return {"max_attempts": ONCE_SINK_ATTEMPTS}
    if kind is not SinkKind.HUB:
        return {}
    from stagerd.sinks.hub.url import parse_hub_url

    return {} if "max_attempts" in parse_hub_url(url).options else {"max_attempts": ONCE_SINK_ATTEMPTS}


def failure_note(f: Failure, step: int, attempt: int, *, on_disk: bool, now: float) -> str:
    """The log's account of a failed attempt: what failed, and when (or whether) it is tried again."""
    if f.given_up and not f.quarantine:  # a --once run's last try of a sink: the lane waits for it
        return (
            f"{f.error_class}: {f.message}; still waiting, not quarantined: out of tries for this --once "
            "run, the next start tries again"
        )
    if f.given_up:  # a --once run's last try of an export that may pass
        return f"{f.error_class}: {f.message}; given up for this --once run: the next start tries again"
    if f.quarantine:
        # Say where the data is: a step deleted by hand mid-export is not "kept on disk".
        kept = "staged data kept on disk" if on_disk else "its staged data is no longer in ROOT"
        return f"{f.error_class}: {f.message}; {kept}; not retried until `stagerd retry ROOT --step {step}`"
    if f.next_try is None:
        return f"{f.error_class}: {f.message}; still waiting, not quarantined: the next start tries again"
    return f"{f.error_class}: {f.message}; retry {attempt + 1} in {f.next_try - now:.0f}s"


def rearmable(error_class: str | None) -> bool:
    """Whether a quarantine recorded under `error_class` was a retryable failure that ran out of tries
    (re-armed when the daemon starts again) rather than one no retry can fix."""
    if error_class is None or error_class in _NEVER_RETRYABLE:
        return False
    if error_class in {cls.__name__ for cls in _WAITS_FOR_A_FIX}:  # quarantined by an older stagerd
        return True
    cls = getattr(errors, error_class, None)
    if isinstance(cls, type) and issubclass(cls, StagerdError):
        return cls.retryable
    return True  # an unexpected exception's class name: retried, as when it happened


def given_up(state: str, error_class: str | None) -> bool:
    """Whether a step or lane is quarantined only because a `--once` run ran out of tries of a failure that
    may pass (`rearmable`): the next start tries it again, where one quarantined for good waits for
    `stagerd retry`. The one rule the summary, `stagerd status` and the start's warning all read."""
    return state == QUARANTINED and rearmable(error_class)


def left_waiting(state: str, next_try: float | None) -> bool:
    """Whether a step or lane is failed with no next try: it waits, not quarantined, for the next start to
    try it again (a sink a `--once` run found down or missing, a fleet step's other nodes)."""
    return state == FAILED and next_try is None


def failure_hint(error_class: str | None, recorded: str | None) -> str | None:
    """What to do about a failure the journal holds: the hint its error gave for its own case, else (a row
    recorded by a stagerd that kept none, or a quarantine the daemon named itself) its class's, which may
    be another case's advice; None for a class without one."""
    if recorded:
        return recorded
    hint = getattr(getattr(errors, error_class or "", None), "hint", None)
    return hint if isinstance(hint, str) else None
