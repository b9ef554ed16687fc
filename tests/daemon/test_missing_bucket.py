"""A sink whose S3 bucket does not exist: the step is fine, the sink is not. It is named at once
(`SinkMissingError`: the bucket, the sink URL, how to create it), nothing is written, and the step is never
quarantined: a `--once` run stops trying at once and exits 1, and a running daemon checks again every
`retry_max_seconds`, so a bucket created later gets the step published.

Before the fix the failure was a retryable `SinkError`: `--once` backed off through `max_attempts` tries
(about 50 s by default) and then quarantined the step's lane."""

from __future__ import annotations

import json
import uuid

import pytest

from stagerd.contract import layout
from tests import s3server
from tests.cli_helpers import clean_env
from tests.daemon_helpers import fast_flags, is_state, run_cli, stage_copy, start_watch, stop_cleanly

pytestmark = pytest.mark.slow
s3_server, s3 = s3server.s3_server, s3server.s3  # moto behind a fault proxy on 127.0.0.1

MANIFEST = f"run/{layout.step_dir_name(100)}/{layout.MANIFEST_NAME}"


def _missing() -> tuple[str, str]:
    bucket = f"stagerd-missing-{uuid.uuid4().hex[:12]}"
    return bucket, f"s3://{bucket}/run"


async def test_once_names_a_missing_bucket_at_once_and_leaves_the_step_waiting(tmp_path, dcp_mixed2, s3):
    src, _ = dcp_mixed2
    root = tmp_path / "root"
    stage_copy(root, 100, src, world=2)
    bucket, url = _missing()
    args = ["watch", str(root), "--sink", url, "--once", *fast_flags()]

    rc, out, err = await run_cli(*args)
    assert rc == 1, out + err
    said = [line for line in err.splitlines() if "SinkMissingError" in line]
    assert said and f"{url}: bucket '{bucket}' does not exist" in said[0], err[-3000:]
    assert f"aws s3 mb s3://{bucket}" in err, err[-3000:]
    assert ".stagerd-probe-" not in err  # the sink is named, not the probe's scratch key
    assert f"{url} still waiting (not quarantined): SinkMissingError" in err, err[-3000:]
    rc, out, _ = await run_cli("status", str(root), "--json")
    (lane,) = json.loads(out)["steps"][0]["lanes"]
    # one try, not `max_attempts` with backoff, and not quarantined: the next start tries again
    assert lane["state"] == "failed" and lane["error_class"] == "SinkMissingError", lane
    assert lane["attempts"] == 1, lane
    # every request the store got was refused: nothing was written
    assert s3.proxy.log and {r.status for r in s3.proxy.log} == {404}
    assert s3.proxy.count("CreateBucket") == 0  # nor a bucket made

    s3.client.create_bucket(Bucket=bucket)
    rc, out, err = await run_cli(*args)
    assert rc == 0, out + err
    assert s3.client.head_object(Bucket=bucket, Key=MANIFEST)["ContentLength"] > 0


async def test_a_running_daemon_publishes_once_the_bucket_is_created(tmp_path, dcp_mixed2, s3):
    src, _ = dcp_mixed2
    root = tmp_path / "root"
    stage_copy(root, 100, src, world=2)
    bucket, url = _missing()
    # the slow cadence of a missing bucket's checks is `retry_max_seconds`: short here
    env = clean_env({"STAGERD_RETRY_MAX_SECONDS": "1"})
    w = await start_watch(root, "--sink", url, *fast_flags(), log_dir=tmp_path / "logs", env=env)
    try:
        failed = await w.wait_for(
            lambda r: r.get("step") == 100 and r.get("error_class") == "SinkMissingError"
        )
        assert failed["state"] == "failed", failed
        s3.client.create_bucket(Bucket=bucket)
        await w.wait_for(is_state(100, "published", url), timeout=120)
    finally:
        await stop_cleanly(w)
    assert not [r for r in w.records() if r.get("state") == "quarantined"], w.text()[-3000:]
    assert s3.client.head_object(Bucket=bucket, Key=MANIFEST)["ContentLength"] > 0
