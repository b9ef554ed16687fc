"""A sink that refuses the daemon's token (or lacks a permission) waits for the fix; its steps are fine.

Each publish refused so is a `SinkAuthError`, logged as an error with its hint, and the step's lane waits,
never quarantined: a running daemon tries again every `retry_max_seconds` (a permission granted at the
destination is picked up), and a restart with a fixed token tries at once. Before, each lane was
quarantined, and after the fix every step needed its own `stagerd retry`, a restart re-arming none."""

from __future__ import annotations

import json

from huggingface_hub import HfApi

from tests.cli_helpers import clean_env, run_cli
from tests.daemon_helpers import fast_flags, stage_copy, start_watch, stop_cleanly
from tests.hubserver import HubServer


def test_a_once_run_refused_leaves_the_steps_waiting_and_the_next_start_with_a_good_token_publishes(
    tmp_path, dcp_mixed2
):
    model, _ = dcp_mixed2
    root = tmp_path / "root"
    for step in (100, 200):
        stage_copy(root, step, model, world=2)
    with HubServer() as hub:
        url = "hf://acme/model"
        args = ["watch", root, "--sink", url, "--once", *fast_flags()]
        env = {"HF_ENDPOINT": hub.endpoint, "HF_TOKEN": hub.read_token}  # it may read, not write
        refused = run_cli(args, env=env)
        out = refused.stdout + refused.stderr
        assert refused.returncode == 1, out[-3000:]
        assert "SinkAuthError" in refused.stderr and hub.read_token not in out, out[-3000:]
        errors = [json.loads(line) for line in refused.stderr.splitlines() if "SinkAuthError" in line]
        assert errors and all(r["level"] == "error" for r in errors), refused.stderr[-3000:]
        status = json.loads(run_cli(["status", root, "--json"]).stdout)
        lanes = [ln for s in status["steps"] for ln in s["lanes"]]
        assert len(lanes) == 2, status
        # each tried once, waiting for the fix with no next try: a restart tries it, no `stagerd retry`
        assert all((ln["state"], ln["next_try"], ln["attempts"]) == ("failed", None, 1) for ln in lanes), (
            lanes
        )
        assert all(ln["error_class"] == "SinkAuthError" for ln in lanes), lanes
        assert all(s["state"] == "exported" for s in status["steps"]), status  # the steps are fine

        fixed = run_cli(args, env={**env, "HF_TOKEN": hub.token})
        assert fixed.returncode == 0, (fixed.stdout + fixed.stderr)[-3000:]
        assert "2 step(s) published" in fixed.stdout, fixed.stdout
        refs = HfApi(endpoint=hub.endpoint, token=hub.token).list_repo_refs("acme/model")
        assert sorted(t.name for t in refs.tags) == ["step-100", "step-200"]


async def test_a_running_daemon_publishes_once_the_permission_is_granted(tmp_path, dcp_mixed2):
    model, _ = dcp_mixed2
    root = tmp_path / "root"
    stage_copy(root, 100, model, world=2)
    with HubServer() as hub:
        url = "hf://acme/model"
        # the cadence of a check that waits for a fix is `retry_max_seconds`: short here
        env = clean_env(
            {"HF_ENDPOINT": hub.endpoint, "HF_TOKEN": hub.read_token, "STAGERD_RETRY_MAX_SECONDS": "1"}
        )
        w = await start_watch(root, "--sink", url, *fast_flags(), log_dir=tmp_path / "logs", env=env)
        try:
            failed = await w.wait_for(
                lambda r: r.get("step") == 100 and r.get("error_class") == "SinkAuthError"
            )
            assert (failed["state"], failed["level"]) == ("failed", "error"), failed
            hub.app.tokens[hub.read_token] = (hub.user, "write")  # the repo's owner grants the write
            await w.wait_for(lambda r: r.get("step") == 100 and r.get("state") == "published", timeout=120)
        finally:
            await stop_cleanly(w)
    assert not [r for r in w.records() if r.get("state") == "quarantined"], w.text()[-3000:]
