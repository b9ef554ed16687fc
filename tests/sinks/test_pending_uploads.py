"""Multipart uploads left pending under a step that remote retention or `stagerd prune` deletes: S3 bills
their parts and no object listing shows them. Before, retention and prune deleted a step's objects by
exact keys and left its pending uploads for good (a writer killed mid-upload: a publisher, a fleet node).
Now each goes with its step, named by key and UploadId, and only those under exactly the deleted step's
prefix: a neighbour one digit longer (`step-000000070/`), step 70 beside step 7, `run-10` beside `run-1`,
a `.bak` copy, another ROOT's step of the same prefix, keep theirs. Moto S3 through the fault proxy; the
steps are the real sink's publishes."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from stagerd.contract import layout
from stagerd.sinks.fetch import RemoteStore
from stagerd.sinks.fsspec import FsspecSink
from stagerd.sinks.prune import Owner, Policy, prune
from tests.cli_helpers import run_cli
from tests.dcp_fixtures import commit_step
from tests.s3proxy import Fault
from tests.s3server import S3Env, s3, s3_server  # noqa: F401  (fixtures)
from tests.sinks.test_sink_fsspec import make_export

S7, S70 = layout.step_dir_name(7), layout.step_dir_name(70)


@dataclass
class Bucket:
    root: Path  # ROOT A, whose steps 7 and 70 are under `run-1/`
    ours: dict[str, str]  # upload id -> key: pending under step 7, which retention deletes
    theirs: dict[str, str]  # upload id -> key: pending beside it, never aborted
    objects: dict[str, bytes]  # other writers' objects beside `run-1/`'s steps


def _published(root: Path, sink: FsspecSink, step: int) -> None:
    """ROOT's step as its daemon publishes it: the raw step, then the export."""
    d = root / layout.step_dir_name(step)
    (d / "model").mkdir(parents=True)
    (d / "model" / "shard.safetensors").write_bytes(bytes([step]) * 1000)
    commit_step(d, 1)
    sink.publish_raw(d, step)
    export = make_export(d / layout.EXPORT_DIR, {"model.safetensors": 700}, step)
    assert not sink.publish(export, step).skipped


def _bucket(env: S3Env, tmp_path: Path) -> Bucket:
    a, b = tmp_path / "a", tmp_path / "b"
    for root in (a, b):
        (root / layout.STATE_DIR).mkdir(parents=True)  # a daemon's ROOT: its identity is fleet-root-id
    sink = FsspecSink.from_url(env.url("run-1"))
    try:
        _published(b, sink, 5)  # another ROOT's step under the same prefix: never this ROOT's to delete
        for step in (7, 70):
            _published(a, sink, step)
    finally:
        sink.close()
    objects = {
        f"run-10/{S7}/model.safetensors": b"run-10's",
        f"run-10/{S7}/{layout.MANIFEST_NAME}": json.dumps(
            {"format": layout.MANIFEST_FORMAT, "step": 7, "files": [], "metadata": {}}
        ).encode(),
        f"run-1/{S7}0/model.safetensors": b"one digit longer",
        f"run-1/{S7}.bak/model.safetensors": b"a person's copy",
        f"run-1/fleet/{S7}/done.json": b"{}",  # step 7's fleet records: they go with its raw step
    }
    for k, v in objects.items():
        env.client.put_object(Bucket=env.bucket, Key=k, Body=v)
    del objects[f"run-1/fleet/{S7}/done.json"]

    def pending(*keys: str) -> dict[str, str]:
        return {env.client.create_multipart_upload(Bucket=env.bucket, Key=k)["UploadId"]: k for k in keys}

    ours = pending(  # killed writers': the export's, a raw part's, a fleet record's
        f"run-1/{S7}/model.safetensors",
        f"run-1/raw/{S7}/node-00001-of-00002/model/shard.safetensors",
        f"run-1/fleet/{S7}/node-00001.json",
    )
    theirs = pending(
        f"run-1/{S70}/model.safetensors",  # step 70: kept
        f"run-1/{S7}0/model.safetensors",  # `step-000000070/`: no step of this prefix
        f"run-1/raw/{S7}0/x",
        f"run-1/fleet/{S7}0/x",
        f"run-1/{S7}.bak/model.safetensors",
        f"run-1/{S7}",  # a flat key named as the step
        f"run-1/raw/{S7}",
        f"run-10/{S7}/model.safetensors",  # `run-10`, whose name starts with `run-1`
        f"run-1/{layout.step_dir_name(5)}/model.safetensors",  # B's step
    )
    return Bucket(a, ours, theirs, objects)


def _pending(env: S3Env) -> dict[str, str]:
    uploads = env.client.list_multipart_uploads(Bucket=env.bucket).get("Uploads", [])
    return {u["UploadId"]: u["Key"] for u in uploads}


def _step_keys(env: S3Env, step: int) -> list[str]:
    name = layout.step_dir_name(step)
    return [k for k in env.keys("run-1/") if k.startswith((f"run-1/{name}/", f"run-1/raw/{name}/"))]


def _neighbours_untouched(env: S3Env, bucket: Bucket) -> None:
    assert {k: env.get(k) for k in bucket.objects} == bucket.objects
    assert _step_keys(env, 5) and _step_keys(env, 70)


def test_retention_aborts_the_uploads_pending_under_a_retired_step_and_no_neighbours(s3, tmp_path):  # noqa: F811
    """The daemon's `--remote-keep-last 1` after publishing step 70 (`prune` with its ROOT's `Owner`, as
    `RawTasks._after_publish` runs it): step 7 goes, export and raw, and with it the uploads pending under
    `run-1/step-00000007/`, `raw/step-00000007/` and its fleet records; every neighbour's stays."""
    bucket = _bucket(s3, tmp_path)
    store = RemoteStore.open(s3.url("run-1"))
    try:
        decisions = prune(store, Policy(keep_last=1), owner=Owner.of(bucket.root))
    finally:
        store.close()
    assert _pending(s3) == bucket.theirs
    assert not _step_keys(s3, 7) and not s3.keys(f"run-1/fleet/{S7}/")
    _neighbours_untouched(s3, bucket)
    gone = {(d.tree, d.step): d.uploads for d in decisions if d.delete}
    assert gone == {("export", 7): 1, ("raw", 7): 2}


def test_prune_aborts_them_and_a_dry_run_only_counts_them(s3, tmp_path):  # noqa: F811
    """`stagerd prune --dry-run` says how many uploads would be aborted and aborts none; `stagerd prune`
    aborts exactly those, under the steps it deletes."""
    bucket = _bucket(s3, tmp_path)
    args = ["prune", s3.url("run-1"), "--keep-last", "1", "--root", str(bucket.root)]
    dry = run_cli([*args, "--dry-run"])
    assert dry.returncode == 0, dry.stderr
    assert _pending(s3) == {**bucket.ours, **bucket.theirs}
    assert _step_keys(s3, 7)
    r = run_cli(args)
    assert r.returncode == 0, r.stderr
    assert _pending(s3) == bucket.theirs
    assert not _step_keys(s3, 7)
    _neighbours_untouched(s3, bucket)
    for n in (1, 2):  # the export's upload; the raw part's and the fleet record's
        assert f"{n} pending multipart upload(s) to abort" in dry.stdout, dry.stdout
        assert f"{n} pending multipart upload(s) aborted" in r.stdout, r.stdout


def test_credentials_that_may_not_list_uploads_still_prune_with_a_warning(s3, tmp_path, caplog):  # noqa: F811
    """Without s3:ListBucketMultipartUploads the step still goes; its uploads are left to the bucket's
    lifecycle rule, said in a warning and in the step's reason."""
    bucket = _bucket(s3, tmp_path)
    s3.proxy.add(Fault(("ListMultipartUploads",), times=100, status=403, code="AccessDenied"))
    store = RemoteStore.open(s3.url("run-1"))
    try:
        with caplog.at_level(logging.WARNING, logger="stagerd.sinks.prune"):
            decisions = prune(store, Policy(keep_last=1), owner=Owner.of(bucket.root))
    finally:
        store.close()
    s3.proxy.reset()
    assert not _step_keys(s3, 7)
    assert _pending(s3) == {**bucket.ours, **bucket.theirs}
    assert "AbortIncompleteMultipartUpload" in caplog.text, caplog.text
    gone = {(d.tree, d.step): d.uploads for d in decisions if d.delete}
    assert gone == {("export", 7): None, ("raw", 7): None}  # not known
