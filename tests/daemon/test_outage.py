"""A sink outage never quarantines a step for good (issue 19, item 10).

A `--once` run gives up on a failure that may pass after `max_attempts` and exits 1; the next start tries
again on its own, without editing the journal. A running daemon keeps retrying (tests/daemon/test_policy).
"""

from __future__ import annotations

import json

from stagerd.contract import layout
from tests.cli_helpers import run_cli
from tests.daemon_helpers import fast_flags, stage_copy
from tests.hubserver import HubServer
from tests.hubserver.faults import Fault


def test_the_next_start_retries_what_an_outage_left_waiting(tmp_path, dcp_mixed2):
    model, _ = dcp_mixed2
    root, sink, mount = tmp_path / "root", tmp_path / "sink", tmp_path / "mnt"
    sink.symlink_to(mount / "sink")  # its filesystem is not mounted: the sink is down
    stage_copy(root, 100, model, world=2)
    args = ["watch", root, "--sink", sink.as_uri(), "--once", "--max-attempts", "1", *fast_flags()]
    down = run_cli(args)
    assert down.returncode == 1, down.stderr[-3000:]
    # what the user reads says the next start tries again, never that only `stagerd retry` will
    assert "the next `stagerd watch` tries those steps again" in down.stdout, down.stdout
    assert "stagerd retry" not in down.stdout + down.stderr, down.stdout + down.stderr[-3000:]
    status = json.loads(run_cli(["status", root, "--json"]).stdout)
    (lane,) = status["steps"][0]["lanes"]
    # it waits for the sink, as for a missing bucket: not quarantined, which sent users to `stagerd retry`
    assert (lane["state"], lane["next_try"]) == ("failed", None), lane
    assert f"the link {sink} -> {mount / 'sink'} leads nowhere" in lane["error_message"], lane  # it is down
    text = run_cli(["status", root], env={"COLUMNS": "200"}).stdout
    assert "tries those steps again" in text and "stagerd retry" not in text, text
    assert "still waiting (not quarantined)" in text and "quarantined " not in text, text

    (mount / "sink").mkdir(parents=True)  # mounted again: the sink is back
    back = run_cli(args)
    assert back.returncode == 0, back.stderr[-3000:]
    assert "re-armed at start" in back.stderr
    assert "quarantined" not in back.stderr, back.stderr[-3000:]
    assert (sink / "step-00000100" / layout.MANIFEST_NAME).is_file()


def test_a_once_run_tries_a_down_sink_max_attempts_times_in_all_and_names_it_once(tmp_path, dcp_mixed2):
    """A cron job's `--once` against a sink that is down ends in bounded time: the sink is tried
    `max_attempts` times in a row in all, not that often per step (every step waiting for it used to spend
    its own tries, so the run grew with the steps); its other steps are left for the next start untried,
    and the summary names the sink once. A sink that is up gets every step in the same run."""
    model, _ = dcp_mixed2
    root, down, up, mount = tmp_path / "root", tmp_path / "down", tmp_path / "up", tmp_path / "mnt"
    down.symlink_to(mount / "sink")  # its filesystem is not mounted: the sink is down
    for step in (100, 200, 300):
        stage_copy(root, step, model, world=2)
    args = ["watch", root, "--sink", down.as_uri(), "--sink", up.as_uri(), "--once", *fast_flags()]
    fast = {"STAGERD_RETRY_BASE_SECONDS": "0.05"}  # the default --max-attempts 5, quick backoff
    run = run_cli(args, env=fast)
    assert run.returncode == 1, run.stderr[-3000:]
    sink = down.as_uri()
    tries = [r for r in _records(run.stderr) if r.get("sink") == sink and r.get("state") == "publishing"]
    assert len(tries) == 5, [r["msg"] for r in tries]  # not 5 per step
    (said,) = [line for line in run.stdout.splitlines() if "is down" in line]
    assert said.startswith(f"  {sink} is down: 3 step(s) left for the next start (100, 200, 300)"), said
    assert "check that the sink is up and reachable" in run.stdout, run.stdout
    assert "stagerd retry" not in run.stdout, run.stdout  # nothing is quarantined for good
    for step in (100, 200, 300):  # the sink that is up has every step
        assert (up / layout.step_dir_name(step) / layout.MANIFEST_NAME).is_file()
    lanes = [ln for s in json.loads(run_cli(["status", root, "--json"]).stdout)["steps"] for ln in s["lanes"]]
    left = [ln for ln in lanes if ln["sink"] == down.as_uri()]
    assert {(ln["state"], ln["next_try"]) for ln in left} == {("failed", None)}, left  # due at the next start
    # the one tried has its own failure; the two the run left untried say why
    assert sorted(ln["error_class"] == "SinkDownError" for ln in left) == [False, True, True], left

    (mount / "sink").mkdir(parents=True)  # the sink is back: the next start publishes every step left
    back = run_cli(args, env=fast)
    assert back.returncode == 0, back.stderr[-3000:]
    for step in (100, 200, 300):
        assert (down / layout.step_dir_name(step) / layout.MANIFEST_NAME).is_file()


def test_a_once_run_against_a_hub_answering_503_keeps_the_hubs_own_tries_few(tmp_path, dcp_mixed2):
    """The Hub sink's own retries run inside each of the run's tries, and their defaults (8 tries of a
    request, backing off to 60 s) made one try of a down Hub last minutes. A `--once` run tries each
    request `ONCE_SINK_ATTEMPTS` times (unless the URL says otherwise), in its `max_attempts` tries of the
    sink in all: 5 x 3 requests, not 8 per try for every step. Its steps wait for the Hub, as for an S3
    bucket that is missing: the log, the summary and `status` say "still waiting (not quarantined)", never
    "quarantined", which sent users to `stagerd retry` for nothing."""
    model, _ = dcp_mixed2
    root = tmp_path / "root"
    for step in (100, 200):
        stage_copy(root, step, model, world=2)
    with HubServer() as hub:
        unavailable = hub.faults.add(Fault("*", "", status=503, times=1 << 30))
        env = {"HF_ENDPOINT": hub.endpoint, "HF_TOKEN": hub.token, "STAGERD_RETRY_BASE_SECONDS": "0.05"}
        url = "hf://acme/down?backoff_base=0.01"  # the Hub's own backoff quick; its tries left to --once
        run = run_cli(["watch", root, "--sink", url, "--once", *fast_flags()], env=env)
    assert run.returncode == 1, run.stderr[-3000:]
    assert unavailable.fired == 5 * 3, run.stderr[-3000:]
    assert "hf://acme/down is down: 2 step(s) left for the next start (100, 200)" in run.stdout, run.stdout
    assert "HTTP 503" in run.stdout, run.stdout
    lines = [r["msg"] for r in _records(run.stderr) if r.get("sink") == "hf://acme/down"]
    assert not [m for m in lines if "quarantined (" in m], lines
    left = [m for m in lines if "still waiting, not quarantined" in m]
    assert [m.split(":")[0] for m in left] == ["step 100 on hf", "step 200 on hf"], lines
    said = [ln for ln in run.stdout.splitlines() if ln.startswith("  step ")]
    assert said and all("hf://acme/down still waiting (not quarantined)" in ln for ln in said), run.stdout
    text = run_cli(["status", root], env={"COLUMNS": "200"}).stdout
    assert "quarantined " not in text and "still waiting (not quarantined): SinkDownError" in text, text
    assert "tries those steps again" in text and "stagerd retry" not in text, text


def test_a_sink_no_longer_configured_never_keeps_a_run_busy(tmp_path, dcp_mixed2):
    """A `--once` run gave a down sink up; the next start, with that sink replaced by another one that is
    down too, re-arms the old sink's lanes though no lane of it is worked on. Before, their due retries woke
    the scheduler at once, again and again: the run spun a CPU and never ended (a running daemon spun for
    good). Now it ends as the first did, the old sink's lanes left as they are."""

    model, _ = dcp_mixed2
    root = tmp_path / "root"
    for step in (100, 200):
        stage_copy(root, step, model, world=2)
    with HubServer() as hub:
        hub.faults.add(Fault("*", "", status=503, times=1 << 30))
        env = {"HF_ENDPOINT": hub.endpoint, "HF_TOKEN": hub.token, "STAGERD_RETRY_BASE_SECONDS": "0.05"}
        once = ["--once", "--max-attempts", "1", *fast_flags()]
        first = run_cli(["watch", root, "--sink", "hf://acme/old?backoff_base=0.01", *once], env=env)
        assert first.returncode == 1, first.stderr[-3000:]
        # a run that never ends fails here, with its stacks
        second = run_cli(
            ["watch", root, "--sink", "hf://acme/new?backoff_base=0.01", *once], env=env, timeout=60
        )
    assert second.returncode == 1, second.stderr[-3000:]
    assert "hf://acme/new is down: 2 step(s) left for the next start (100, 200)" in second.stdout, (
        second.stdout
    )
    assert "acme/old" not in second.stdout, second.stdout


def _records(stderr: str) -> list[dict]:
    return [json.loads(line) for line in stderr.splitlines() if line.startswith("{")]
