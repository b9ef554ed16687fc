"""The S3 upload schedule and what verifies a step, against a real moto server through the fault proxy:
the order requests reach the store in, which requests verification needs, and the sweep beside them."""

from __future__ import annotations

import hashlib
import json
import os
import socket
from pathlib import Path
from typing import Any

import pytest

from stagerd.contract import layout
from stagerd.errors import SinkConflictError, SinkError
from stagerd.sinks import open_sink
from stagerd.sinks.claims import claim_key, publish_claim
from stagerd.sinks.fsspec import FsspecSink
from stagerd.sinks.s3.backend import S3Backend
from stagerd.sinks.s3.client import signs_payload
from tests import s3server
from tests.s3server import steps_log

s3_server, s3 = s3server.s3_server, s3server.s3  # the fixtures

MiB = 1 << 20
BIG = {"a.safetensors": 11 * MiB, "b.safetensors": 11 * MiB}  # three 5 MiB parts each
SMALL = {"config.json": 300, "tokenizer.json": 70_000, layout.INDEX_NAME: 900}


def make_export(root: Path, sizes: dict[str, int]) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for i, (rel, size) in enumerate(sorted(sizes.items())):
        block = hashlib.sha256(f"{i}".encode()).digest() * 2048
        (root / rel).write_bytes((block * (size // len(block) + 1))[:size])
    return root


def sink(env: Any, concurrency: int = 4) -> FsspecSink:
    return open_sink(env.url("ckpt"), part_size=5 * MiB, max_concurrency=concurrency)


def uploads(env: Any) -> list[tuple[str, str]]:
    """(operation, file name) of every upload request the store answered, in arrival order."""
    ops = ("PutObject", "UploadPart", "CreateMultipartUpload", "CompleteMultipartUpload")
    return [(r.op, r.key.rsplit("/", 1)[-1]) for r in steps_log(env) if r.op in ops and r.status == 200]


def test_small_files_go_first_and_parts_go_in_file_order(s3, tmp_path):
    """One slot: the files that go in one PUT are sent before any part, smallest first, and a file's parts
    all go before the next file's, so each file's completion overlaps the next file's parts. A one-PUT file
    worth two parts of memory still goes when there is only one slot."""
    one_put = {**SMALL, "mid.safetensors": 7 * MiB}
    export = make_export(tmp_path / "e", {**BIG, **one_put})
    assert not sink(s3, concurrency=1).publish(export, 1).skipped
    parts = [name for op, name in uploads(s3) if op in ("PutObject", "UploadPart")]
    steps = [n for n in parts if n not in (layout.MANIFEST_NAME, "latest", "step-00000001")]  # its claim
    assert steps[:4] == sorted(one_put, key=one_put.__getitem__)
    assert steps[4:] == ["a.safetensors"] * 3 + ["b.safetensors"] * 3


def test_store_answers_verify_without_a_head_per_file(s3, tmp_path):
    """moto answers a PutObject with the checksum it stored, so single-PUT files need no HEAD; its
    CompleteMultipartUpload answer carries none, so each multipart file gets exactly one, right after."""
    export = make_export(tmp_path / "e", {**BIG, **SMALL})
    assert not sink(s3).publish(export, 2).skipped
    heads = [r.key.rsplit("/", 1)[-1] for r in s3.proxy.log if r.op == "HeadObject"]
    assert sorted(heads) == sorted(BIG)
    for name in BIG:  # the HEAD follows that file's completion, before the manifest
        log = [(r.op, r.key.rsplit("/", 1)[-1]) for r in s3.proxy.log]
        assert log.index(("CompleteMultipartUpload", name)) < log.index(("HeadObject", name))
        assert log.index(("HeadObject", name)) < log.index(("PutObject", layout.MANIFEST_NAME))
    ops = [(r.op, r.key.rsplit("/", 1)[-1]) for r in s3.proxy.log]
    listings = [r for r in steps_log(s3) if r.op == "ListObjects"]  # less the probe's of its scratch keys
    assert len(listings) == 1, "one listing, at the start: the answers verified"
    assert ops.index(("PutObject", layout.MANIFEST_NAME)) < ops.index(("PutObject", "latest"))
    manifest = json.loads(s3.get(f"ckpt/step-00000002/{layout.MANIFEST_NAME}"))
    assert {f["path"]: f["sha256"] for f in manifest["files"]} == {
        rel: hashlib.sha256((export / rel).read_bytes()).hexdigest() for rel in {**BIG, **SMALL}
    }


class _WrongAnswers(S3Backend):
    """A store that reports another checksum than the one sent for `victim`, as a store holding other
    bytes would: everything else is the real backend on the real server."""

    victim = "config.json"

    def _wrong(self, key: str, r: Any) -> Any:
        if r is not None and key.endswith(self.victim) and f"Checksum{self.algorithm}" in r:
            r = {**r, f"Checksum{self.algorithm}": "AAAAAA=="}
        return r

    async def call(self, where: str, method: str, **kwargs: Any) -> Any:
        return self._wrong(kwargs.get("Key", ""), await super().call(where, method, **kwargs))

    async def put_new(self, where: str, **kwargs: Any) -> Any:  # the create-only PUTs of the opening
        return self._wrong(kwargs.get("Key", ""), await super().put_new(where, **kwargs))


def test_a_wrong_checksum_in_the_answer_fails_the_step_before_the_manifest(s3, tmp_path):
    export = make_export(tmp_path / "e", {**BIG, **SMALL})
    real = sink(s3)._backend
    assert isinstance(real, S3Backend)
    wrong = _WrongAnswers(real.fs, real.bucket, real.root, real.part_size, real.max_concurrency)
    with pytest.raises(SinkError) as ei:
        FsspecSink(s3.url("ckpt"), wrong).publish(export, 3)
    assert ei.value.retryable and "config.json" in str(ei.value) and "AAAAAA==" in str(ei.value)
    assert not [k for k in s3.keys("ckpt/") if layout.MANIFEST_NAME in k or k.endswith("latest")]


def test_stale_uploads_are_swept_and_ours_are_not(s3, tmp_path):
    """A restarted publisher finds its own claim on the step and sweeps what its killed run left pending,
    before it starts any multipart upload of its own, so it aborts only the dead run's."""
    export = make_export(tmp_path / "e", BIG)
    key = "ckpt/step-00000004/a.safetensors"
    stale = s3.client.create_multipart_upload(Bucket=s3.bucket, Key=key)["UploadId"]
    claim = publish_claim(export).encode()  # the killed run's claim: the same tree on the same host
    s3.client.put_object(Bucket=s3.bucket, Key=f"ckpt/{claim_key('step-00000004')}", Body=claim)
    assert not sink(s3).publish(export, 4).skipped
    assert s3.client.list_multipart_uploads(Bucket=s3.bucket).get("Uploads", []) == []
    aborted = [r for r in s3.proxy.log if r.op == "AbortMultipartUpload"]
    assert len(aborted) == 1 and aborted[0].status in (200, 204)
    assert s3.get(key) == (export / "a.safetensors").read_bytes()
    assert stale not in str(s3.client.list_multipart_uploads(Bucket=s3.bucket))


def test_a_file_that_grows_while_uploading_is_refused(s3, tmp_path):
    """The producer reads to the end of the file: more bytes than scanned stop the upload at once."""
    export = make_export(tmp_path / "e", {"a.safetensors": 11 * MiB})
    first = sink(s3, concurrency=1)  # the first part is sent before the rest are read

    def grow(done: int, total: int) -> None:
        with open(export / "a.safetensors", "ab") as f:
            f.write(os.urandom(6 * MiB))

    with pytest.raises(SinkError) as ei:
        first.publish(export, 5, progress=grow)
    assert "changed while publishing" in str(ei.value) and ei.value.retryable
    assert s3.client.list_multipart_uploads(Bucket=s3.bucket).get("Uploads", []) == []
    assert not [k for k in s3.keys("ckpt/") if layout.MANIFEST_NAME in k]


def test_a_file_under_two_parts_is_one_put_and_a_rerun_agrees(s3, tmp_path):
    """Under two parts' worth a file is one PUT (no multipart round trips, no assembly in the store), and
    the checksum a re-run computes from the local file is that PUT's, so the step verifies and is reused."""
    export = make_export(tmp_path / "e", {"mid.safetensors": 7 * MiB, **SMALL})
    assert not sink(s3).publish(export, 7).skipped
    assert s3.proxy.count("UploadPart", "CreateMultipartUpload") == 0
    assert s3.proxy.count("PutObject", key_contains="mid.safetensors") == 1

    s3.proxy.reset()
    assert sink(s3).publish(export, 7).skipped  # verified again against the local checksums
    s3.client.delete_object(Bucket=s3.bucket, Key=f"ckpt/step-00000007/{layout.MANIFEST_NAME}")
    s3.proxy.reset()
    res = sink(s3).publish(export, 7)
    assert not res.skipped and res.bytes_uploaded == 0  # every file reused on its checksum
    # a fresh sink tried it create-only, was refused, and reused what is there
    assert [r.status for r in s3.proxy.log if r.op == "PutObject" and "mid." in r.key] == [412]


def test_a_small_step_opens_with_its_puts_alone(s3, tmp_path):
    """A step whose files all go in one PUT sends them create-only at once, with the read of `latest`: no
    sweep (it has no multipart upload) and no listing (a taken key refuses the PUT). After them, the
    manifest, then `latest`. A fresh sink publishing it again finds its PUTs refused, lists, reads the
    manifest and finds it the same; the sink that wrote `latest` does not read it again."""
    export = make_export(tmp_path / "e", SMALL)
    first = sink(s3)
    assert not first.publish(export, 8).skipped
    ops = [(r.op, r.key.rsplit("/", 1)[-1]) for r in steps_log(s3)]
    claim = ("PutObject", "step-00000008")  # ckpt/claims/step-00000008
    opening = sorted([("GetObject", "latest"), claim, *(("PutObject", n) for n in SMALL)])
    assert sorted(ops[: len(opening)]) == opening
    assert ops[len(opening) :] == [("PutObject", layout.MANIFEST_NAME), ("PutObject", "latest")]
    s3.proxy.reset()
    assert sink(s3).publish(export, 8).skipped
    assert [r.status for r in steps_log(s3) if r.op == "PutObject"] == [412] * (len(SMALL) + 1)
    assert s3.proxy.count("ListObjects") >= 1  # the opening's, then the published step's verification
    assert s3.proxy.count("GetObject", key_contains=layout.MANIFEST_NAME) == 1
    s3.proxy.reset()
    assert not first.publish(export, 9).skipped
    assert s3.proxy.count("GetObject") == 0 and s3.get("ckpt/latest") == layout.step_dir_name(9).encode()


def test_a_step_with_multipart_files_opens_with_its_claim_and_the_listing(s3, tmp_path):
    """Multipart files wait for the claim and the listing, and the one-PUT files go create-only beside
    them. A fresh claim means no publisher came before: no sweep."""
    export = make_export(tmp_path / "e", {**BIG, **SMALL})
    assert not sink(s3).publish(export, 8).skipped
    ops = [(r.op, r.key.rsplit("/", 1)[-1]) for r in s3.proxy.log]
    first_part = next(i for i, (op, _) in enumerate(ops) if op == "CreateMultipartUpload")
    assert "ListObjects" in {op for op, _ in ops[:first_part]}
    assert ("PutObject", "step-00000008") in ops[:first_part]  # ckpt/claims/step-00000008
    assert s3.proxy.count("GetObject", key_contains=layout.MANIFEST_NAME) == 0
    assert s3.proxy.count("ListMultipartUploads") == 0


def test_a_conflicting_published_step_keeps_its_files_and_loses_our_strays(s3, tmp_path):
    """Create-only PUTs go out before the listing shows the step published: they cannot touch its files
    (refused), and a file the published step does not have, created early, is removed before the conflict
    is raised."""
    first = make_export(tmp_path / "a", SMALL)
    assert not sink(s3).publish(first, 9).skipped
    before = {k: s3.get(k) for k in s3.keys("ckpt/")}
    other = make_export(tmp_path / "b", {**{k: v + 1 for k, v in SMALL.items()}, "extra.json": 10})
    with pytest.raises(SinkConflictError) as ei:
        sink(s3).publish(other, 9)
    # who published it there, as its claim says: another run of this prefix (a directory, not a ROOT)
    assert f"published by another run (host {socket.gethostname()}, directory {first})" in ei.value.message
    assert "give each run its own prefix" in (ei.value.hint or ""), ei.value.hint
    assert {k: s3.get(k) for k in s3.keys("ckpt/")} == before
    created = [r for r in s3.proxy.log if r.op == "PutObject" and r.key.endswith("extra.json")]
    assert [r.status for r in created][-1] == 200, "the stray was created early, then deleted"


def test_latest_moves_only_forward_when_it_changes_behind_the_sink(s3, tmp_path):
    """The sink writes `latest` only over the version it knows, here its own last write, without reading
    it first. Another writer moving it meanwhile makes that write fail: the re-read keeps a newer step
    and overwrites an older one."""
    export = make_export(tmp_path / "e", SMALL)
    for moved_to, want in ((20, 20), (5, 11)):
        prefix = f"ckpt{moved_to}"
        sink_ = open_sink(s3.url(prefix), part_size=5 * MiB, max_concurrency=4)
        assert not sink_.publish(export, 10).skipped
        s3.client.put_object(
            Bucket=s3.bucket, Key=f"{prefix}/latest", Body=layout.step_dir_name(moved_to).encode()
        )
        s3.proxy.reset()
        assert not sink_.publish(export, 11).skipped
        assert s3.get(f"{prefix}/latest") == layout.step_dir_name(want).encode()
        statuses = [r.status for r in s3.proxy.log if r.op == "PutObject" and r.key.endswith("/latest")]
        assert statuses == ([412] if want == 20 else [412, 200]), statuses
        assert s3.proxy.count("GetObject", key_contains="latest") == 1  # only after the refusal


def test_the_signed_payload_hash_is_the_uploaders_own_and_the_store_checks_it(s3, tmp_path):
    """Over plain http every body's sha256 is signed, and the store checks it against the body (the test
    server does, as S3 does). The uploader computes it with the read and the signer takes it: each part's
    signed hash is that part's sha256, and for a file in one PUT it is the file's sha256, which the
    manifest records (one sha256 pass over such a file, not two)."""
    export = make_export(tmp_path / "e", {**BIG, **SMALL, "mid.safetensors": 7 * MiB})
    assert not sink(s3).publish(export, 11).skipped
    manifest = json.loads(s3.get(f"ckpt/step-00000011/{layout.MANIFEST_NAME}"))
    recorded = {f["path"]: f["sha256"] for f in manifest["files"]}
    for rel in [*SMALL, "mid.safetensors"]:
        put = [r for r in s3.proxy.log if r.op == "PutObject" and r.key.endswith("/" + rel)]
        assert [r.status for r in put] == [200]
        assert (
            recorded[rel] == put[0].content_sha256 == hashlib.sha256((export / rel).read_bytes()).hexdigest()
        )
    for rel in BIG:
        body = (export / rel).read_bytes()
        assert recorded[rel] == hashlib.sha256(body).hexdigest()
        parts = [r for r in s3.proxy.log if r.op == "UploadPart" and r.key.endswith("/" + rel)]
        want = [hashlib.sha256(body[i : i + 5 * MiB]).hexdigest() for i in range(0, len(body), 5 * MiB)]
        assert sorted(r.content_sha256 for r in parts) == sorted(want)  # parts may arrive in any order


def test_a_wrong_digest_handed_to_the_signer_is_refused_by_the_store(s3):
    """The signer signs the digest it is handed, and the store checks the body against it: a wrong one
    fails the request instead of storing bytes under a hash they do not have."""
    from stagerd.sinks.s3.client import BODY_SHA256

    backend = sink(s3)._backend
    assert isinstance(backend, S3Backend)
    with pytest.raises(SinkError) as ei:
        backend._run(
            backend.call, "x", "put_object", Key="ckpt/x", Body=bytearray(b"abc"), **{BODY_SHA256: "0" * 64}
        )
    assert "XAmzContentSHA256Mismatch" in str(ei.value)
    assert "ckpt/x" not in s3.keys("ckpt/")


@pytest.mark.parametrize(
    ("endpoint", "config", "signs"),
    [
        ("http://127.0.0.1:9", None, True),
        ("https://s3.example.invalid", None, False),
        ("https://s3.example.invalid", {"payload_signing_enabled": True}, True),
        ("http://127.0.0.1:9", {"payload_signing_enabled": False}, False),
    ],
)
def test_the_uploader_hashes_files_itself_where_the_client_signs_no_payload(endpoint, config, signs):
    """Over https with a checksum (or with signing off) botocore signs `UNSIGNED-PAYLOAD`: there is no
    signed hash to take."""
    import boto3
    from botocore.config import Config

    client = boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id="k",
        aws_secret_access_key="s",
        config=Config(s3=config),
    )
    assert signs_payload(client) is signs


def test_without_a_signed_payload_the_uploader_hashes_every_file(s3, tmp_path):
    """Payload signing off (as over https): the requests carry no body hash, and the manifest's sha256 of
    every file is the uploader's own."""
    export = make_export(tmp_path / "e", {**BIG, **SMALL})
    opts = {"config_kwargs": {"s3": {"payload_signing_enabled": False}}}
    unsigned = open_sink(s3.url("ckpt"), part_size=5 * MiB, max_concurrency=4, storage_options=opts)
    assert not unsigned.publish(export, 12).skipped
    puts = [r for r in s3.proxy.log if r.op in ("PutObject", "UploadPart")]
    assert puts and {r.content_sha256 for r in puts} == {"UNSIGNED-PAYLOAD"}
    manifest = json.loads(s3.get(f"ckpt/step-00000012/{layout.MANIFEST_NAME}"))
    assert {f["path"]: f["sha256"] for f in manifest["files"]} == {
        rel: hashlib.sha256((export / rel).read_bytes()).hexdigest() for rel in {**BIG, **SMALL}
    }


def test_parts_share_a_few_buffers_and_each_arrives_as_it_was_read(s3, tmp_path):
    """Two slots, seven distinct parts (the last one short): part buffers are reused as soon as a part is
    sent and hashed, and no part goes out with another part's bytes (the store checks each part's CRC32
    and signed sha256, and the object and the manifest match the file)."""
    export = tmp_path / "e"
    export.mkdir()
    body = os.urandom(31 * MiB)
    (export / "a.safetensors").write_bytes(body)
    assert not sink(s3, concurrency=2).publish(export, 9).skipped
    assert s3.proxy.count("UploadPart") == 7
    assert s3.get("ckpt/step-00000009/a.safetensors") == body
    manifest = json.loads(s3.get(f"ckpt/step-00000009/{layout.MANIFEST_NAME}"))
    assert manifest["files"][0]["sha256"] == hashlib.sha256(body).hexdigest()


def test_the_free_list_keeps_only_part_sized_buffers(s3, tmp_path):
    """Every file's short last part has a buffer of its own, which is not kept: after three multipart
    files through two slots the free list holds at most two buffers, all of them part-sized."""
    from stagerd.sinks.objects import ByteProgress, LocalFile
    from stagerd.sinks.s3.upload import Uploads

    export = make_export(tmp_path / "e", {"a.bin": 11 * MiB, "b.bin": 12 * MiB, "c.bin": 13 * MiB})
    files = [LocalFile(p.name, p, p.stat().st_size) for p in sorted(export.iterdir())]
    backend = sink(s3, concurrency=2)._backend
    assert isinstance(backend, S3Backend)
    up = Uploads(backend, "ckpt/step-00000013", files, ByteProgress(sum(f.size for f in files), None))
    done = backend._run(up.run)
    assert [d.size for d in done] == [f.size for f in files]
    kept = [len(b) for bufs in up.spares.values() for b in bufs]
    assert kept and len(kept) <= 2 and set(kept) == {5 * MiB}, kept


def test_big_bodies_go_to_aiohttp_in_slices_of_the_buffer():
    """A part's `bytearray` is handed to aiohttp as views of at most `SEND_SLICE` bytes, in order, and the
    payload can be written again (botocore rewinds a body before it retries)."""
    import asyncio

    from stagerd.sinks.s3.client import SEND_SLICE, _send_in_slices

    class Request:
        def __init__(self, body: Any) -> None:
            self.body = body

    small, big = Request(bytearray(100)), Request(bytearray(os.urandom(2 * SEND_SLICE + 5)))
    _send_in_slices(small)
    _send_in_slices(big)
    assert isinstance(small.body, bytearray)
    payload = big.body
    assert payload.size == 2 * SEND_SLICE + 5

    class Writer:
        def __init__(self) -> None:
            self.chunks: list[bytes] = []

        async def write(self, chunk: memoryview) -> None:
            self.chunks.append(bytes(chunk))

    for length in (None, SEND_SLICE + 1):
        writer = Writer()
        payload.seek(0)
        asyncio.run(payload.write_with_length(writer, length))
        sent = b"".join(writer.chunks)
        assert sent == bytes(big.body._value)[:length] and max(map(len, writer.chunks)) <= SEND_SLICE


def test_a_new_client_comes_with_its_connection_pool_and_error_classes(s3, tmp_path):
    """The one-time costs of a client are paid when it is made, not by the first request of a step, which
    every other request of the step would wait behind: aiobotocore's aiohttp session (its TLS context
    loads the CA bundle) and botocore's error classes. If aiobotocore moves its session, this fails, and
    the first request pays again."""
    fresh = sink(s3)
    backend = fresh._backend
    assert isinstance(backend, S3Backend)
    client = backend._run(backend._client)
    assert client._endpoint.http_session._sessions  # made with the client
    assert client._exceptions is not None
    export = make_export(tmp_path / "e", SMALL)
    assert not fresh.publish(export, 1).skipped  # and the pool made early serves the uploads
