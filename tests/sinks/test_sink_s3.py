"""The fsspec sink on a real moto S3 over HTTP (s3fs/aiobotocore), through the test server's fault proxy."""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from pathlib import Path

import pytest

from stagerd.contract import layout
from stagerd.errors import SinkConflictError, SinkError
from stagerd.sinks import open_sink
from stagerd.sinks.fsspec import FsspecSink
from stagerd.sinks.hashing import hash_file
from tests import s3server
from tests.s3server import ACCESS_KEY, SECRET_KEY, Fault, steps_log
from tests.sinks.test_sink_fsspec import make_export, tree_bytes

s3_server, s3 = s3server.s3_server, s3server.s3  # the fixtures

MiB = 1 << 20
S3_FILES = {
    "model-00001-of-00002.safetensors": 12 * MiB + 12_345,  # three 5 MiB parts
    "model-00002-of-00002.safetensors": 700_001,
    layout.INDEX_NAME: 1234,
    "extras/README.md": 99,
}
WRITES = ("PutObject", "UploadPart", "CreateMultipartUpload", "CompleteMultipartUpload")


def s3_sink(env, prefix: str = "ckpt", **kw) -> FsspecSink:
    return open_sink(env.url(prefix), part_size=5 * MiB, max_concurrency=4, **kw)


def assert_published(env, export: Path, step: int, prefix: str = "ckpt") -> dict:
    base = f"{prefix}/{layout.step_dir_name(step)}"
    local = tree_bytes(export)
    manifest = json.loads(env.get(f"{base}/{layout.MANIFEST_NAME}"))
    assert {f["path"]: (f["size"], f["sha256"]) for f in manifest["files"]} == {
        k: (len(v), hashlib.sha256(v).hexdigest()) for k, v in local.items()
    }
    for rel, data in local.items():
        assert env.get(f"{base}/{rel}") == data, rel
    assert env.get(f"{prefix}/latest") == layout.step_dir_name(step).encode()
    return manifest


@pytest.mark.parametrize("algorithm", ["CRC32", "SHA256"])
def test_s3_publish_downloads_back_and_rerun_uploads_nothing(s3, tmp_path, algorithm):
    export = make_export(tmp_path / "e", S3_FILES)
    sink = s3_sink(s3, checksum=algorithm)
    assert sink.url == s3.url("ckpt") and not sink.is_published(12)
    res = sink.publish(export, 12)
    assert not res.skipped and res.bytes_uploaded == sum(S3_FILES.values()) and res.files == 4
    assert res.location == f"{s3.url('ckpt')}/step-00000012"
    assert_published(s3, export, 12)
    assert s3.proxy.count("UploadPart") == 3 and s3.proxy.count("CompleteMultipartUpload") == 1
    for rel in S3_FILES:  # the store kept the checksums the sink sent, and they are right
        key = f"ckpt/step-00000012/{rel}"
        head = s3.client.head_object(Bucket=s3.bucket, Key=key, ChecksumMode="ENABLED")
        want = hash_file(export / rel, 5 * MiB, algorithm).checksum
        assert head[f"Checksum{algorithm}"].split("-")[0] == want.split("-")[0], rel
    assert sink.is_published(12)

    s3.proxy.reset()  # a daemon's retry: its sink has opened this step before, so it sends nothing early
    again = sink.publish(export, 12)
    assert again.skipped and again.bytes_uploaded == 0
    assert s3.proxy.count(*WRITES) == 0 and s3.proxy.bytes_in() == 0
    sink.close()

    before = {k: s3.get(k) for k in s3.keys("ckpt/")}
    s3.proxy.reset()  # a restarted daemon: the one-PUT files go create-only and are refused, nothing changes
    fresh = s3_sink(s3, checksum=algorithm)
    again = fresh.publish(export, 12)
    assert again.skipped and again.bytes_uploaded == 0
    writes = [(r.op, r.status, r.key) for r in steps_log(s3) if r.op in WRITES]
    assert writes and all(w[:2] == ("PutObject", 412) for w in writes), writes
    # the three files under two parts and the step's claim; the multipart one is never re-sent
    assert sorted(w[2].rsplit("/", 1)[-1] for w in writes) == sorted(
        ["README.md", "model-00002-of-00002.safetensors", layout.INDEX_NAME, "step-00000012"]
    )
    assert {k: s3.get(k) for k in s3.keys("ckpt/")} == before
    fresh.close()


def test_s3_transient_faults_are_retried_and_publish_once(s3, tmp_path):
    export = make_export(tmp_path / "e", S3_FILES)
    p = s3.proxy
    p.add(Fault(ops=("UploadPart",), times=2, status=500, code="InternalError"))
    p.add(Fault(ops=("UploadPart",), times=1, drop_after=64 * 1024))
    p.add(Fault(ops=("PutObject",), times=1, status=503, code="SlowDown"))
    p.add(Fault(ops=("CreateMultipartUpload",), times=1, status=429, code="TooManyRequests", retry_after=1))
    p.add(Fault(ops=("PutObject",), times=1, status=500, key_contains=layout.MANIFEST_NAME))
    res = s3_sink(s3).publish(export, 3)
    assert not res.skipped
    assert_published(s3, export, 3)
    statuses = sorted(r.status for r in p.log if r.status != 200)
    assert statuses.count(500) == 3 and 503 in statuses and 429 in statuses and 0 in statuses
    assert all(f.times == 0 for f in p.faults), "every injected fault was hit"
    ok_manifest_puts = [r for r in p.log if layout.MANIFEST_NAME in r.key and r.op == "PutObject"]
    assert [r.status for r in ok_manifest_puts] == [500, 200]


def test_s3_crash_mid_multipart_then_rerun_completes(s3, tmp_path, monkeypatch):
    """Connections dropped mid-part past the client's retries fail the step; a re-run sends only the rest."""
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "2")
    export = make_export(tmp_path / "e", S3_FILES)
    big = "model-00001-of-00002.safetensors"
    s3.proxy.add(Fault(ops=("UploadPart",), times=1000, after=1, drop_after=1 * MiB, key_contains=big))
    sink = s3_sink(s3)  # the daemon retries a step on the sink it holds open
    with pytest.raises(SinkError) as ei:
        sink.publish(export, 8)
    assert ei.value.retryable and big in str(ei.value) and s3.url("ckpt") in str(ei.value)
    landed = s3.keys("ckpt/")
    assert f"ckpt/step-00000008/{layout.MANIFEST_NAME}" not in landed and "ckpt/latest" not in landed
    assert f"ckpt/step-00000008/{big}" not in landed
    assert landed, "the small files finished before the big one failed"
    assert not s3_sink(s3).is_published(8)

    s3.proxy.reset()
    res = sink.publish(export, 8)
    assert not res.skipped and res.bytes_uploaded < sum(S3_FILES.values())
    assert_published(s3, export, 8)
    for key in landed:
        assert s3.proxy.count("PutObject", "UploadPart", key_contains=key) == 0, f"{key} was sent twice"
    assert s3.proxy.count("PutObject", key_contains=layout.MANIFEST_NAME) == 1


def test_s3_rerun_after_a_restart_is_refused_early_and_reuses_what_landed(s3, tmp_path, monkeypatch):
    """A fresh sink (a restarted daemon) sends a partial step's one-PUT files create-only beside its
    listing: each that landed before is refused (412), never overwritten, then checked and reused; the big
    file's parts go as before, and the step verifies."""
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "2")
    export = make_export(tmp_path / "e", S3_FILES)
    big = "model-00001-of-00002.safetensors"
    s3.proxy.add(Fault(ops=("UploadPart",), times=1000, after=1, drop_after=1 * MiB, key_contains=big))
    with pytest.raises(SinkError):
        s3_sink(s3).publish(export, 9)
    landed = {k: s3.get(k) for k in s3.keys("ckpt/")}
    assert len(landed) == 4 and not [k for k in landed if big in k or layout.MANIFEST_NAME in k]
    assert "ckpt/claims/step-00000009" in landed  # the restarted publisher's own claim

    s3.proxy.reset()
    res = s3_sink(s3).publish(export, 9)
    assert not res.skipped and res.bytes_uploaded == S3_FILES[big]
    assert_published(s3, export, 9)
    for key in landed:
        puts = [r.status for r in s3.proxy.log if r.op == "PutObject" and r.key.endswith(key)]
        assert puts == [412], (key, puts)
    assert {k: s3.get(k) for k in landed} == landed


@pytest.mark.parametrize("size", ["same", "other"])
def test_s3_wrong_remote_file_is_replaced_after_a_check(s3, tmp_path, caplog, size):
    """An object with other bytes at a file's key in an unpublished step (a foreign or stale upload) is not
    overwritten blindly: the create-only PUT is refused, the checked path finds its checksum or size wrong,
    says so, and only then replaces it."""
    export = make_export(tmp_path / "e", S3_FILES)
    rel = "model-00002-of-00002.safetensors"
    key = f"ckpt/step-00000004/{rel}"
    body = b"\0" * (S3_FILES[rel] + (0 if size == "same" else 1))
    s3.client.put_object(Bucket=s3.bucket, Key=key, Body=body, ChecksumAlgorithm="SHA256")
    s3.proxy.reset()
    caplog.set_level("WARNING", logger="stagerd.sinks.fsspec")
    s3_sink(s3).publish(export, 4)
    assert_published(s3, export, 4)
    assert [r.status for r in s3.proxy.log if r.op == "PutObject" and rel in r.key] == [412, 200]
    assert any(rel in m and "replaced" in m for m in caplog.messages), caplog.messages


def test_s3_server_down_then_up(s3, tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "10")
    export = make_export(tmp_path / "e", S3_FILES)
    went_down = []

    def progress(done: int, total: int) -> None:
        if not went_down:
            went_down.append(s3.server.down_for(1.0))

    res = s3_sink(s3).publish(export, 6, progress=progress)
    assert went_down and not res.skipped
    assert_published(s3, export, 6)


def test_s3_permanent_failure_is_a_retryable_sink_error_and_commits_nothing(s3, tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "2")
    export = make_export(tmp_path / "e", {"a.safetensors": 1000, "b.json": 10})
    s3.proxy.add(Fault(ops=("PutObject",), times=1000, status=500, key_contains="a.safetensors"))
    with pytest.raises(SinkError) as ei:
        s3_sink(s3).publish(export, 2)
    assert type(ei.value) is SinkError and ei.value.retryable
    assert "a.safetensors" in str(ei.value) and "InternalError" in str(ei.value)
    assert s3.proxy.count("PutObject", key_contains="a.safetensors") == 2  # bounded: AWS_MAX_ATTEMPTS
    assert not [k for k in s3.keys("") if layout.MANIFEST_NAME in k]


@pytest.mark.parametrize("env", [None, "1"])
def test_s3_max_attempts_bounds_the_clients_tries_unless_the_aws_environment_does(
    s3, tmp_path, monkeypatch, env
):
    """A `--once` run opens an S3 sink with `max_attempts=3`: botocore's own default (5, backing off
    randomly up to 8 s) ran inside each of the run's tries of a down sink. AWS_MAX_ATTEMPTS, AWS_RETRY_MODE
    or the config file's setting is the user's, and wins."""
    if env is not None:
        monkeypatch.setenv("AWS_MAX_ATTEMPTS", env)
    export = make_export(tmp_path / "e", {"a.safetensors": 1000, "b.json": 10})
    s3.proxy.add(
        Fault(ops=("PutObject",), times=1000, status=503, code="SlowDown", key_contains="a.safetensors")
    )
    sink = s3_sink(s3, max_attempts=2)
    try:
        with pytest.raises(SinkError):
            sink.publish(export, 3)
    finally:
        sink.close()  # its probe's scratch keys deleted now, not in the next test
    assert s3.proxy.count("PutObject", key_contains="a.safetensors") == (2 if env is None else 1)


@pytest.mark.parametrize("which", ["secret", "key"])
def test_s3_bad_credentials_are_an_auth_error_without_the_secret(s3, tmp_path, monkeypatch, which):
    bad_secret = "wrong-secret-8c1f0e"
    if which == "secret":
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", bad_secret)
    else:
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIA-NOT-KNOWN")
    export = make_export(tmp_path / "e", {"a": 10})
    with pytest.raises(SinkError) as ei:
        s3_sink(s3).publish(export, 1)
    err = ei.value
    assert type(err).__name__ == "SinkAuthError" and not err.retryable
    text = f"{err} {err.hint}"
    assert bad_secret not in text and SECRET_KEY not in text
    assert ("SignatureDoesNotMatch" if which == "secret" else "InvalidAccessKeyId") in text
    # the daemon's hint names S3's credentials and the refused request, not the Hub's token
    assert "AWS_ACCESS_KEY_ID" in err.hint and "s3:PutObject" in err.hint and "HF_TOKEN" not in err.hint
    # A small step opens with its PUT, its claim and the read of latest, together: the first 403 ends the
    # step, so a request still unsent then is never sent. None is retried.
    ops = Counter(r.op for r in s3.proxy.log)
    assert ops and ops <= Counter(GetObject=1, PutObject=2), ops
    assert all(r.status == 403 for r in s3.proxy.log), ops


def test_s3_conflicting_manifest_is_refused(s3, tmp_path):
    s3_sink(s3).publish(make_export(tmp_path / "a", {"x.safetensors": 100}, seed=1), 5)
    before = s3.get(f"ckpt/step-00000005/{layout.MANIFEST_NAME}")
    with pytest.raises(SinkConflictError):
        s3_sink(s3).publish(make_export(tmp_path / "b", {"x.safetensors": 100}, seed=2), 5)
    assert s3.get(f"ckpt/step-00000005/{layout.MANIFEST_NAME}") == before


def test_s3_manifest_write_is_conditional(s3):
    backend = s3_sink(s3)._backend
    assert backend.create("k/m.json", b"one") is True
    assert backend.create("k/m.json", b"two") is False
    assert s3.get("ckpt/k/m.json") == b"one"
    assert [r.status for r in steps_log(s3) if r.op == "PutObject"] == [200, 412]


def test_s3_connection_from_storage_options_and_generic_endpoint_env(s3, tmp_path, monkeypatch):
    export = make_export(tmp_path / "e", {"a": 10})
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3")
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3.server.endpoint)
    assert not s3_sink(s3, prefix="via-env").publish(export, 1).skipped
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    opts = {"endpoint_url": s3.server.endpoint, "key": ACCESS_KEY, "secret": SECRET_KEY}
    sink = s3_sink(s3, prefix="via-opts", storage_options=opts)
    assert SECRET_KEY not in repr(vars(sink)["url"])
    assert not sink.publish(export, 1).skipped
    assert s3.get("via-opts/step-00000001/a") == (export / "a").read_bytes()
