"""A listing names only keys under the prefix it asked for: a store that answers with others (a server
that ignores S3's `Prefix`, a sibling whose name only starts with the step's) never makes them keys of
the step, so no publish, sweep or prune acts on another step's or another prefix's objects.

The store is moto behind a proxy that drops `prefix=` from every listing (as a broken S3-compatible store
does), read through the real aiobotocore client and the real s3fs."""

from __future__ import annotations

import json
import threading
import urllib.parse
from collections.abc import Iterator
from typing import Any

import pytest
from werkzeug.serving import make_server

from stagerd.contract import layout
from stagerd.sinks.fetch import RemoteStore
from stagerd.sinks.generic import FsspecBackend
from stagerd.sinks.prune import prune
from stagerd.sinks.prune_plan import Policy
from stagerd.sinks.s3.backend import S3Backend
from tests.s3server import FaultProxy, S3Env, s3, s3_server  # noqa: F401  (fixtures)


class PrefixIgnored(FaultProxy):
    """The fault proxy, less the `prefix` of each listing it forwards: the store lists the whole bucket."""

    def _forward(
        self, method: str, raw_uri: str, headers: dict[str, str], body: bytes
    ) -> tuple[int, list[tuple[str, str]], bytes]:
        path, _, query = raw_uri.partition("?")
        if method == "GET" and path.strip("/").count("/") == 0:
            kept = [(k, v) for k, v in urllib.parse.parse_qsl(query, keep_blank_values=True) if k != "prefix"]
            raw_uri = f"{path}?{urllib.parse.urlencode(kept)}"
        return super()._forward(method, raw_uri, headers, body)


@pytest.fixture
def ignoring(s3: S3Env, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:  # noqa: F811
    """The endpoint of a store that ignores `Prefix`, in the AWS environment of the clients under test."""
    proxy = PrefixIgnored(upstream=s3.server.moto.get_host_and_port())
    server = make_server("127.0.0.1", 0, proxy, threaded=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    endpoint = f"http://127.0.0.1:{server.server_port}"
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", endpoint)
    yield endpoint
    server.shutdown()
    server.server_close()
    thread.join()


def _put_step(s3: S3Env, prefix: str, step: int, names: tuple[str, ...] = ("model.safetensors",)) -> None:  # noqa: F811
    base = f"{prefix}/{layout.step_dir_name(step)}"
    for name in names:
        s3.client.put_object(Bucket=s3.bucket, Key=f"{base}/{name}", Body=b"w" * 10)
    manifest = {"format": layout.MANIFEST_FORMAT, "step": step, "files": [], "metadata": {}}
    s3.client.put_object(Bucket=s3.bucket, Key=f"{base}/{layout.MANIFEST_NAME}", Body=json.dumps(manifest))


def test_a_step_lists_none_of_a_sibling_steps_keys(s3, ignoring):  # noqa: F811
    """`step-1` and `step-10`: before, the listing of step 1 took `ckpt/step-10/model.safetensors` for
    `0/model.safetensors` of step 1, and every key of the bucket for some name of the step."""
    _put_step(s3, "ckpt", 1, ("a.safetensors",))
    _put_step(s3, "ckpt", 10)
    _put_step(s3, "other", 1, ("x.safetensors",))
    b = S3Backend.open(s3.url("ckpt"), {}, part_size=5 << 20, max_concurrency=2, checksum="CRC32")
    try:
        assert set(b.list(layout.step_dir_name(1))) == {"a.safetensors", layout.MANIFEST_NAME}
    finally:
        b.close()


def test_a_prune_counts_no_step_of_another_prefix(s3, ignoring):  # noqa: F811
    """Our steps 1 and 2 under `ckpt`, another run's 3 and 4 under `ckpu` (a name as long): before, the
    listing of `ckpt/step-` sliced `ckpu/step-3/...` to `step-3/...`, so keep-last 2 counted the other
    run's steps as this sink's newest and chose to delete both of ours."""
    for step in (1, 2):
        _put_step(s3, "ckpt", step)
    for step in (3, 4):
        _put_step(s3, "ckpu", step)
    store = RemoteStore.open(s3.url("ckpt"))
    try:
        decisions = prune(store, Policy(keep_last=2), dry_run=True)
    finally:
        store.close()
    assert {(d.tree, d.step, d.delete) for d in decisions} == {("export", 1, False), ("export", 2, False)}


def test_an_fsspec_store_lists_no_key_outside_the_step(s3, ignoring):  # noqa: F811
    """The generic backend over s3fs, against the same store: only the step's own keys are its files."""
    import s3fs

    _put_step(s3, "ckpt", 1, ("a.safetensors",))
    _put_step(s3, "ckpt", 10)
    fs = s3fs.S3FileSystem(skip_instance_cache=True, client_kwargs={"endpoint_url": ignoring})
    found: dict[str, Any] = FsspecBackend(fs, f"{s3.bucket}/ckpt").list(layout.step_dir_name(1))
    assert set(found) == {"a.safetensors", layout.MANIFEST_NAME}


def test_a_probe_deletes_no_scratch_key_of_another_prefix(s3, ignoring):  # noqa: F811
    """A dead probe's scratch key under `ckpu` (another run, a name as long): before, the probe's tidy-up
    of `ckpt` sliced it to a scratch name of its own and deleted `ckpu/...`, a key outside its prefix."""
    from stagerd.sinks.s3.conditions import PROBE_PREFIX
    from stagerd.sinks.temp_names import HOST

    foreign = f"ckpu/{PROBE_PREFIX}{HOST}-999999999-{'0' * 32}-put"
    s3.client.put_object(Bucket=s3.bucket, Key=foreign, Body=b"")
    b = S3Backend.open(s3.url("ckpt"), {}, part_size=5 << 20, max_concurrency=2, checksum="CRC32")
    try:
        assert b.create("stagerd-claim-test", b"{}")
    finally:
        b.close()  # waits for the probe's tidy-up
    assert foreign in s3.keys("ckpu/")


def test_a_sweep_aborts_no_upload_of_a_sibling_step(s3, ignoring):  # noqa: F811
    """A multipart upload pending under `step-10`: the sweep of `step-1` leaves it."""
    key = f"ckpt/{layout.step_dir_name(10)}/model.safetensors"
    upload = s3.client.create_multipart_upload(Bucket=s3.bucket, Key=key)["UploadId"]
    b = S3Backend.open(s3.url("ckpt"), {}, part_size=5 << 20, max_concurrency=2, checksum="CRC32")
    try:
        b.sweep(layout.step_dir_name(1))
    finally:
        b.close()
    pending = s3.client.list_multipart_uploads(Bucket=s3.bucket).get("Uploads", [])
    assert [(u["Key"], u["UploadId"]) for u in pending] == [(key, upload)]


def test_a_prune_aborts_no_upload_of_a_sibling_step_or_prefix(s3, ignoring):  # noqa: F811
    """Pending multipart uploads under `ckpt/step-1` (pruned), `step-10` (kept), `ckpu/step-1` and the flat
    key `ckpt/step-1`: the prune of step 1 aborts only its own, though the store lists them all."""
    for step in (1, 10):
        _put_step(s3, "ckpt", step)
    s1 = layout.step_dir_name(1)
    s3.client.create_multipart_upload(Bucket=s3.bucket, Key=f"ckpt/{s1}/a.safetensors")  # aborted
    theirs = {
        s3.client.create_multipart_upload(Bucket=s3.bucket, Key=k)["UploadId"]: k
        for k in (f"ckpt/{layout.step_dir_name(10)}/a", f"ckpu/{s1}/a", f"ckpt/{s1}", f"ckpt/{s1}0/a")
    }
    store = RemoteStore.open(s3.url("ckpt"))
    try:
        decisions = prune(store, Policy(keep_last=1))
    finally:
        store.close()
    pending = s3.client.list_multipart_uploads(Bucket=s3.bucket).get("Uploads", [])
    assert {u["UploadId"]: u["Key"] for u in pending} == theirs
    assert [(d.step, d.uploads) for d in decisions if d.delete] == [(1, 1)]
