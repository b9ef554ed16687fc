"""What went wrong on one rank, and the check-ins that make every rank fail the save alike.

Whatever fails on one rank, every rank's handle and `wait()` raise the same `SaveError`, naming the
failing rank and the cause, and no marker is written. No rank is ever left waiting in a collective that
another rank skipped: `save()` checks in once before anything is written (a refusal on one rank is a
refusal on all), and after that each rank runs the same sequence of check-ins (staging, DCP's model
write, one before the optimizer's write when there is one, the write, the commit); a rank's failure is
carried to the next check-in instead of skipping ahead. A rank that dies, or a group whose `timeout`
runs out, fails the save on the ranks that notice ("lost contact"), which then keep no marker.

Errors leave here without reference cycles through the frames that raised them: such a cycle keeps the
caller's state dict, its DeviceMesh and process groups alive until the cyclic collector runs, possibly
only at interpreter exit, when gloo's threads can no longer take the GIL (see `shutdown`).
"""

from __future__ import annotations

import errno
import logging
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

from torch.distributed.checkpoint.api import CheckpointException

from stagerd.errors import (
    DTypeError,
    HubPlanError,
    ReferenceIndexError,
    SaveError,
    SaveInputError,
    StagerdError,
    StepExistsError,
)
from stagerd.training.collectives import Collectives
from stagerd.training.save_inputs import SaveSpec

log = logging.getLogger("stagerd.stage")

_DISK_FULL = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}


def _causes(exc: BaseException) -> list[tuple[str, BaseException]]:
    """(where, exception) of every rank failure inside a DCP CheckpointException, or the exception itself."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        return [
            (f"rank {rank}", wrapped[0] if isinstance(wrapped, tuple) else wrapped)
            for rank, wrapped in sorted(failures.items())
        ]
    return [("", exc)]


def describe(exc: BaseException) -> str:
    """One line naming each failing rank and its error."""
    return "; ".join(f"{where + ': ' if where else ''}{type(e).__name__}: {e}" for where, e in _causes(exc))


def _disk_full(exc: BaseException) -> bool:
    return any(isinstance(e, OSError) and e.errno in _DISK_FULL for _, e in _causes(exc))


@dataclass(frozen=True)
class RankFailure:
    """What went wrong on one rank, as it travels to the others in a check-in (one line)."""

    text: str
    disk_full: bool = False

    @classmethod
    def of(cls, doing: str, exc: BaseException) -> RankFailure:
        return cls(f"{doing} failed: {describe(exc)}", _disk_full(exc))


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def clear_frames(exc: BaseException) -> None:
    """Drop the locals of every frame in `exc`'s tracebacks, its causes' and DCP's per-rank failures'."""
    pending: list[BaseException] = [exc]
    seen: set[int] = set()
    while pending:
        error = pending.pop()
        if id(error) in seen:
            continue
        seen.add(id(error))
        traceback.clear_frames(error.__traceback__)
        pending.extend(e for e in (error.__cause__, error.__context__) if e is not None)
        if isinstance(error, CheckpointException):
            for failure in error.failures.values():
                inner = failure[0] if isinstance(failure, tuple) else failure
                if isinstance(inner, BaseException):
                    pending.append(inner)


def raise_without_cycle(error: BaseException) -> NoReturn:
    """Raise `error` from a frame that does not keep it (`raise e` from a frame holding `e` is a cycle)."""
    try:
        raise error
    finally:
        del error


def failed_here(spec: SaveSpec, rank: int, doing: str, exc: BaseException) -> RankFailure:
    """Log this rank's failure and keep only its text (DCP's error is in a cycle with its writer
    thread's frames, which hold our process group, and its traceback reaches the committer's frames)."""
    failure = RankFailure.of(doing, exc)
    log.error("step %d: save failed on rank %d: %s", spec.step, rank, failure.text)
    clear_frames(exc)
    exc.__traceback__ = None
    return failure


def check_in_to_start(comm: Collectives, step: int, error: StagerdError | None, with_optimizer: bool) -> None:
    """save()'s check-in before anything is written: raise on every rank if any rank refused.

    One small all_reduce on the common path (this is inside the training stall); the details only when
    something is off.
    """
    try:
        refused, with_optim = comm.sum([error is not None, with_optimizer])
    except Exception as e:  # a rank died or the group timed out
        raise SaveError(f"step {step}: lost contact with the other ranks: {type(e).__name__}: {e}") from e
    if not refused and with_optim in (0, comm.world):
        return
    status = None if error is None else (error.name, str(error), error.hint)
    statuses = comm.all_gather((status, with_optimizer))
    if error is None:
        raise _refusal_elsewhere(step, statuses)
    try:
        raise error
    finally:  # `error` raised from this frame must not stay in it: a cycle
        error = None


# What a refusing rank raised, raised as such on the others too, with its hint.
_REFUSALS = (SaveInputError, StepExistsError, DTypeError, ReferenceIndexError, HubPlanError)


def _refusal_elsewhere(step: int, statuses: list[Any]) -> StagerdError:
    for rank, (status, _) in enumerate(statuses):
        if status is not None:
            name, text, hint = status
            cls = next((c for c in _REFUSALS if c.__name__ == name), SaveInputError)
            return cls(f"rank {rank} refused the save of step {step}: {name}: {text}", hint=hint)
    ranks = [r for r, (_, has_optim) in enumerate(statuses) if has_optim]
    return SaveInputError(f"step {step}: only ranks {ranks} passed optimizer_state; pass it on all")


def check_in(
    comm: Collectives,
    spec: SaveSpec,
    what: str,
    local: RankFailure | None,
    payload: Any = None,
    *,
    on_failure: Callable[[], None] | None = None,
) -> list[Any]:
    """Every rank says how `what` went on it; if it failed on any rank, raise SaveError on every rank.

    Returns every rank's payload. A broken group (a rank died, the group's timeout ran out) fails the
    save on the ranks that see it rather than leaving them waiting. `on_failure` runs before the raise
    when every rank checked in (so none is still writing) and one failed.
    """
    try:
        statuses = comm.all_gather((local, payload))
    except Exception as e:
        raise SaveError(
            f"step {spec.step} was not committed: lost contact with the other ranks while {what}: "
            f"{type(e).__name__}: {e}",
            path=spec.step_dir,
        ) from e
    by_text: dict[str, list[int]] = {}
    for rank, (f, _) in enumerate(statuses):
        if f is not None:
            by_text.setdefault(f.text, []).append(rank)
    if by_text:
        # DCP reports one rank's write failure on every rank: say each distinct failure once
        msg = "; ".join(f"{text} (reported by {_ranks(ranks)})" for text, ranks in by_text.items())
        error = SaveError(f"step {spec.step} was not committed: {msg}", path=spec.step_dir)
        if any(f is not None and f.disk_full for f, _ in statuses):
            error.hint = "the staging disk is full: free space on the staging root and save again"
        if on_failure is not None:
            try:
                on_failure()
            except Exception as e:  # cleaning up must never hide the failure itself
                log.warning("step %d: cannot remove the failed save's files: %s", spec.step, e)
        raise error
    return [p for _, p in statuses]
