"""The retry policy: non-retryable errors quarantine at once; others back off, doubling, until attempts
run out."""

from __future__ import annotations

from stagerd.config import load_settings
from stagerd.daemon.policy import backoff_delay, decide_failure, rearmable
from stagerd.errors import FleetWaitError, ShardError, SinkAuthError, SinkError


def test_retry_policy_quarantines_non_retryable_at_once_and_backs_off_otherwise():
    s = load_settings(None, retry_base_seconds=2.0, retry_max_seconds=5.0, max_attempts=3, once=True)
    f = decide_failure(ShardError("truncated", path="x"), 1, s, now=100.0)
    assert f.quarantine and f.error_class == "ShardError" and f.next_try is None
    f1 = decide_failure(SinkError("503"), 1, s, now=100.0)
    f2 = decide_failure(SinkError("503"), 2, s, now=100.0)
    assert (f1.quarantine, f1.next_try) == (False, 102.0)
    assert (f2.quarantine, f2.next_try) == (False, 104.0)
    assert decide_failure(SinkError("503"), 3, s, now=100.0).quarantine
    assert decide_failure(OSError(5, "EIO"), 1, s, now=0).error_class == "OSError"


def test_backoff_doubles_from_the_base_and_stops_at_the_cap():
    s = load_settings(None, retry_base_seconds=1.5, retry_max_seconds=10.0)
    assert [backoff_delay(n, s) for n in range(1, 6)] == [1.5, 3.0, 6.0, 10.0, 10.0]


def test_a_running_daemon_never_gives_up_on_a_failure_that_may_pass():
    """Issue 19, item 10: a 95 s sink outage used to quarantine steps for good."""
    s = load_settings(None, retry_base_seconds=2.0, retry_max_seconds=300.0, max_attempts=3)
    f = decide_failure(SinkError("503"), 1000, s, now=100.0)
    assert (f.quarantine, f.next_try) == (False, 400.0)  # the capped backoff, still retrying
    assert decide_failure(SinkAuthError("bad token"), 1, s, now=0).quarantine  # this one never passes


def test_which_quarantines_a_restart_re_arms():
    assert rearmable("SinkError") and rearmable("OSError") and rearmable("TimeoutError")
    assert not rearmable("SinkAuthError") and not rearmable("ShardError")
    assert not rearmable("StepConflictError") and not rearmable("CrashLoop") and not rearmable("MissingStep")
    assert not rearmable(None)


def test_a_fleet_wait_is_never_quarantined_and_ends_a_once_run_at_the_first_timeout():
    once = load_settings(None, max_attempts=5, once=True)
    f = decide_failure(FleetWaitError("waiting for node 1 (seen: node-00000-of-00002)"), 1, once, now=0)
    assert (f.error_class, f.quarantine, f.next_try) == ("FleetWaitError", False, None)  # left waiting
    running = load_settings(None, retry_base_seconds=2.0, max_attempts=1)
    f = decide_failure(FleetWaitError("waiting for node 1"), 50, running, now=100.0)
    assert not f.quarantine and f.next_try is not None and f.next_try > 100.0  # backs off, waits again
