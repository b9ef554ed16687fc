"""The retry policy: non-retryable errors quarantine at once; others back off, doubling, until attempts
run out."""

from __future__ import annotations

from stagerd.config import Settings
from stagerd.daemon.policy import (
    backoff_delay,
    decide_failure,
    failure_note,
    gives_up_sink,
    once_sink_options,
    rearmable,
    sink_outage,
)
from stagerd.daemon.settings_sources import load_settings
from stagerd.errors import FleetWaitError, ShardError, SinkAuthError, SinkError, SinkMissingError
from stagerd.sinks.hub.url import RetryPolicy


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
    assert decide_failure(ShardError("truncated"), 1, s, now=0).quarantine  # this one never passes
    # a refused token waits for its fix like a missing bucket, checked again at the cap: never quarantined
    f = decide_failure(SinkAuthError("bad token"), 1, s, now=100.0)
    assert (f.quarantine, f.next_try, f.needs_fix) == (False, 400.0, True)


def test_which_quarantines_a_restart_re_arms():
    assert rearmable("SinkError") and rearmable("OSError") and rearmable("TimeoutError")
    assert not rearmable("ShardError")
    assert rearmable("SinkAuthError")  # an older stagerd's quarantine of a refused token: tried again
    assert not rearmable("StepConflictError") and not rearmable("CrashLoop") and not rearmable("MissingStep")
    assert not rearmable(None)


def test_a_fleet_wait_is_never_quarantined_and_ends_a_once_run_at_the_first_timeout():
    once = load_settings(None, max_attempts=5, once=True)
    f = decide_failure(FleetWaitError("waiting for node 1 (seen: node-00000-of-00002)"), 1, once, now=0)
    assert (f.error_class, f.quarantine, f.next_try) == ("FleetWaitError", False, None)  # left waiting
    running = load_settings(None, retry_base_seconds=2.0, max_attempts=1)
    f = decide_failure(FleetWaitError("waiting for node 1"), 50, running, now=100.0)
    assert not f.quarantine and f.next_try is not None and f.next_try > 100.0  # backs off, waits again


async def test_a_retry_set_by_a_clock_that_went_back_since_is_due_now(tmp_path, dcp_mixed2):
    """A failed try records its next try by the wall clock. A clock that then goes back (NTP corrects one
    that ran a day ahead, a VM resumes) must not hold the retry back by the jump: the policy never sets one
    later than `retry_max_seconds` from now, so one found later is due now."""
    import time

    from stagerd.daemon.discovery import save_identity
    from stagerd.daemon.journal import Journal
    from tests.daemon_helpers import fast_flags, manifests, run_cli, stage_copy

    root, sink = tmp_path / "root", tmp_path / "sink"
    step_dir = stage_copy(root, 1, dcp_mixed2[0], 2)
    j = Journal.open(root)  # what a daemon whose clock ran a day ahead recorded for its retry
    j.add_step(1, step_dir, time.time(), save_identity(step_dir))
    j.begin_export(1)
    j.fail_export(1, "OutputError", "No space left", next_try=time.time() + 86400, quarantine=False)
    j.close()
    rc, _, err = await run_cli(
        "watch", str(root), "--sink", sink.as_uri(), "--once", *fast_flags(), timeout=30
    )
    assert rc == 0 and list(manifests(sink)) == [1], err
    assert "the clock went back" in err, err  # said once, in the log


def test_a_missing_bucket_is_never_quarantined_and_checked_again_only_slowly():
    """The step is fine, its sink's bucket absent: a `--once` run stops at the first try (it used to back off
    through `max_attempts` tries, then quarantine), a running daemon looks again every `retry_max_seconds`."""
    missing = SinkMissingError("bucket 'b' does not exist", path="s3://b/run")
    f = decide_failure(missing, 1, load_settings(None, max_attempts=5, once=True), now=0)
    assert (f.error_class, f.quarantine, f.next_try) == ("SinkMissingError", False, None)  # left waiting
    running = load_settings(None, retry_base_seconds=2.0, retry_max_seconds=300.0)
    assert decide_failure(missing, 1, running, now=100.0).next_try == 400.0  # not 2 s, then 4 s...
    assert decide_failure(missing, 1000, running, now=100.0).quarantine is False


def test_a_once_run_waits_on_a_down_sink_about_a_minute_at_most_by_default():
    """A `--once` run from cron must end in bounded time when a sink is down. Its tries of a sink count in
    a row whichever steps they are for (`daemon/outages.py`), so its waits are `max_attempts` tries of the
    sink with the run's backoff between them, each try waiting in the sink's own retries. The Hub's own
    default (8 tries of each request, backing off to 60 s) made that over ten minutes, per step."""
    s = load_settings(None, once=True)
    assert s.max_attempts == 5 and s.retry_base_seconds == 2.0  # the defaults this bound is of
    hub = once_sink_options("hf://acme/model")["max_attempts"]
    assert once_sink_seconds(s, hub_try_waits(hub)) <= 60
    assert once_sink_seconds(s, hub_try_waits(RetryPolicy.max_attempts)) > 600  # the sink's own default
    s3 = once_sink_options("s3://bucket/run")["max_attempts"]
    assert once_sink_seconds(s, s3_try_waits(s3)) <= 60
    assert once_sink_seconds(s, s3_try_waits(5)) > 100  # botocore's own default
    # the URL's own setting is the user's: kept (S3's, in the AWS environment, the sink keeps)
    assert once_sink_options("hf://acme/model?max_attempts=8") == {}
    assert once_sink_options("file:///tmp/x") == {}


def test_only_a_once_run_gives_up_a_sink_and_only_on_what_may_pass():
    once = load_settings(None, retry_base_seconds=2.0, max_attempts=3, once=True)
    running = load_settings(None, retry_base_seconds=2.0, max_attempts=3)
    assert gives_up_sink(decide_failure(SinkError("503"), 3, once, now=0), once)
    assert not gives_up_sink(decide_failure(SinkError("503"), 2, once, now=0), once)
    assert not gives_up_sink(decide_failure(SinkError("503"), 3, running, now=0), running)
    assert not gives_up_sink(decide_failure(SinkAuthError("bad token"), 1, once, now=0), once)
    # a sink's failed tries in a row: what may pass counts, an answer about the step does not
    assert sink_outage(decide_failure(SinkError("503"), 1, once, now=0))
    assert sink_outage(decide_failure(SinkError("503"), 3, once, now=0))
    assert not sink_outage(decide_failure(SinkAuthError("bad token"), 1, once, now=0))
    assert not sink_outage(decide_failure(SinkMissingError("no bucket"), 1, once, now=0))
    assert rearmable("SinkDownError")  # the steps it left: tried again by the next start


def test_a_publish_a_once_run_gives_up_waits_and_is_never_quarantined():
    """Its sink was down; the step is fine. Quarantined, `stagerd status` sent users to `stagerd retry`."""
    once = load_settings(None, max_attempts=3, once=True)
    f = decide_failure(SinkError("connection refused"), 3, once, now=0, publish=True)
    assert (f.quarantine, f.next_try, f.given_up) == (False, None, True)
    assert "still waiting, not quarantined" in failure_note(f, 2, 3, on_disk=True, now=0)
    assert gives_up_sink(f, once) and sink_outage(f)
    f = decide_failure(SinkAuthError("bad token"), 1, once, now=0, publish=True)
    assert (f.quarantine, f.next_try, f.given_up) == (False, None, False)  # waits for the fix, next start
    assert decide_failure(ShardError("truncated"), 1, once, now=0).quarantine


def once_sink_seconds(settings: Settings, try_waits: float) -> float:
    """The longest a `--once` run waits on a sink that stays down, where one try of it waits at most
    `try_waits` seconds in the sink's own retries: `max_attempts` tries of the sink in all, whichever steps
    they are for, with the run's backoff between them. Time spent in requests themselves (a connect
    timeout) comes on top."""
    backoff = sum(backoff_delay(k, settings) for k in range(1, settings.max_attempts))
    return backoff + settings.max_attempts * try_waits


def s3_try_waits(attempts: int) -> float:
    """The longest an S3 request waits in botocore's retries with `attempts` tries, in its default
    (legacy) mode: a random fraction of 1, 2, 4... seconds before each retry."""
    return sum(2.0 ** (k - 1) for k in range(1, attempts))


def hub_try_waits(attempts: int) -> float:
    """The longest a Hub sink's request waits in its own retries with `attempts` tries (default backoff,
    no Retry-After from the Hub)."""
    policy = RetryPolicy(max_attempts=attempts)
    return sum(min(policy.backoff_max, policy.backoff_base * 2 ** (k - 1)) for k in range(1, attempts))


def test_a_hint_kept_in_the_journal_holds_no_secret():
    """A hint may quote a sink's URL; the journal keeping it is read by anyone who runs `stagerd status`."""
    from stagerd.daemon.work_failures import recorded_hint

    err = SinkError(
        "refused",
        hint="check https://bob:pw-SECRET@host/b?sig=SIG-SECRET or hf_TOKENSECRET123 for file:///a/b.",
    )
    hint = recorded_hint(err, on_disk=True)
    assert hint is not None and "SECRET" not in hint, hint
    assert "https://bob:***@host/b" in hint and "file:///a/b." in hint, hint
    assert recorded_hint(ValueError("no hint"), on_disk=True) is None
