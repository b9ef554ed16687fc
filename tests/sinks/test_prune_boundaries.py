"""Remote retention and the S3 sink against what else a bucket holds: prefixes that share a beginning
(`run1`, `run10`, `run1-old`), a person's objects beside the steps, names with spaces, unicode, percent
signs and glob characters, listings of more than one page, per-key refusals inside a 200 `DeleteObjects`
answer, a versioned bucket, and other tools' pending multipart uploads. Stores: moto S3 through the fault
proxy, and fsspec's `memory://` through the generic path (`RemoteStore` on a non-S3, non-local store).
"""

from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from stagerd.contract import layout
from stagerd.errors import SinkError
from stagerd.sinks.claims import claim_key, publish_claim
from stagerd.sinks.fsspec import FsspecSink
from stagerd.sinks.prune import Policy, prune
from stagerd.sinks.remote import RemoteStore
from tests.cli_helpers import run_cli
from tests.s3server import s3, s3_server  # noqa: F401  (fixtures)
from tests.sinks.test_sink_fsspec import make_export

MiB = 1 << 20
HOSTILE = "a b/ü [1]*?{x} %41+é.bin"  # a file of a step: space, unicode, glob, percent escape, plus


def _step(put: Callable[[str, bytes], None], prefix: str, step: int, names: list[str]) -> dict[str, bytes]:
    """A complete step at `prefix/step-N/` as a publisher leaves it: its files, then its manifest."""
    base = f"{prefix}/{layout.step_dir_name(step)}".lstrip("/")  # prefix "": the bucket's root
    files = {f"{base}/{n}": f"{n}@{step}".encode() for n in names}
    manifest = {
        "format": layout.MANIFEST_FORMAT,
        "step": step,
        "files": [{"path": n, "size": len(f"{n}@{step}"), "sha256": "0" * 64} for n in names],
        "metadata": {},
    }
    files[f"{base}/{layout.MANIFEST_NAME}"] = json.dumps(manifest).encode()
    for k, v in files.items():
        put(k, v)
    return files


def _others(put: Callable[[str, bytes], None], *, flat: bool = True) -> dict[str, bytes]:
    """What retention of `run1` must never touch: other prefixes' steps, and a person's objects under
    `run1/` outside its steps (names a loose match, a pattern or a bad decoding would take for a step's)."""
    found: dict[str, bytes] = {}
    for prefix in ("run10", "run1-old", "run1 ", "run1%2F"):
        for step in (1, 2):
            found |= _step(put, prefix, step, ["model.safetensors"])
    for rel in (
        "README",
        "step-5-notes.txt",
        *(["step-00000001"] if flat else []),  # an object named as the step itself (a flat store's)
        "step-00000001.bak/model.safetensors",
        "step-00000001.bak/" + layout.MANIFEST_NAME,
        "step-00000001-notes/x",
        "step-1/" + layout.MANIFEST_NAME,
        "notes [v*?]{a}.txt",
        "ü 100%25 done.txt",
        "raw/README",
        "claims-old/step-00000001",
        "claims/step-00000001.bak",  # a person's copy of a claim: no claim of step 1 or of a node part
        "claims/step-00000002.node-00000-of-00002.bak",
        "restoring-notes",
        "latest.bak",
    ):
        put(f"run1/{rel}", rel.encode())
        found[f"run1/{rel}"] = rel.encode()
    return found


def _run1(put: Callable[[str, bytes], None]) -> dict[int, dict[str, bytes]]:
    steps = {s: _step(put, "run1", s, ["model.safetensors", HOSTILE]) for s in (1, 2, 3)}
    put("run1/latest", layout.step_dir_name(3).encode())
    return steps


def test_pruning_run1_on_s3_deletes_its_steps_whole_and_no_other_key(s3):  # noqa: F811
    put = _putter(s3)

    others, steps = _others(put), _run1(put)
    r = run_cli(["prune", s3.url("run1"), "--keep-last", "1"])
    assert r.returncode == 0, r.stderr
    left = {k: s3.get(k) for k in s3.keys("")}
    assert {k: v for k, v in left.items() if k in others} == others  # every other key, byte for byte
    assert not set(steps[1]) & set(left) and not set(steps[2]) & set(left)  # the hostile name went too
    assert {k for k in left if k.startswith("run1/step-00000003/")} == set(steps[3])


def test_pruning_run1_on_a_generic_fsspec_store_deletes_no_other_key():
    """The same through the generic fsspec path (`memory://`): `find` and `rm_file`, never a pattern. A
    step holding a name with glob characters is left whole, with its manifest (`rm_file` of an async store
    without its own may expand it): a named reason, and the other steps still go."""
    import fsspec

    fs = fsspec.filesystem("memory")
    root = "/prune-bounds"

    def put(key: str, data: bytes) -> None:
        fs.pipe_file(f"{root}/{key}", data)

    try:
        others, steps = _others(put, flat=False), _run1(put)
        _step(put, "run1", 4, ["model.safetensors"])
        put("run1/latest", layout.step_dir_name(4).encode())
        store = RemoteStore.open(f"memory://{root}/run1")
        decisions = {(d.tree, d.step): d for d in prune(store, Policy(keep_last=1))}
        left = {k.removeprefix(fs._strip_protocol(root) + "/"): fs.cat_file(k) for k in fs.find(root)}
        assert {k: v for k, v in left.items() if k in others} == others
        for s in (1, 2, 3):  # each holds the hostile name: kept whole, said why
            assert not decisions["export", s].delete and "glob" in decisions["export", s].reason
            assert {k: left.get(k) for k in steps[s]} == steps[s]
        assert (
            not (set(left) - set(others))
            - {k for s in steps.values() for k in s}
            - {
                "run1/latest",
                f"run1/step-00000004/{layout.MANIFEST_NAME}",
                "run1/step-00000004/model.safetensors",
            }
        )
    finally:
        fs.rm(root, recursive=True)


def test_steps_past_the_first_listing_page_are_seen_and_deleted_whole(s3):  # noqa: F811
    """1,100 files in step 1, so steps 2 and 3 (and most of step 1) are past the first 1,000-key page of
    the `step-` listing, and step 1's delete takes two `DeleteObjects`: a listing that stopped at one
    page would keep step 2 (step 3 unseen, step 2 the newest complete) and leave step 1's tail."""
    names = [f"shard-{i:05d}.bin" for i in range(1100)]

    put = _putter(s3)

    with ThreadPoolExecutor(16) as pool:  # the keys of step 1, written directly to moto
        base = f"run/{layout.step_dir_name(1)}"
        list(pool.map(lambda n: put(f"{base}/{n}", b"x"), names))
    _step(put, "run", 1, [])
    for s in (2, 3):
        _step(put, "run", s, ["model.safetensors"])
    fates = _fates(s3.url("run"))
    assert fates == {1: True, 2: True, 3: False}
    assert sorted(s3.keys("run/")) == sorted(
        f"run/step-00000003/{n}" for n in (layout.MANIFEST_NAME, "model.safetensors")
    )
    # step 1: its manifest, then its 1,100 files in two requests; step 2: its manifest, then its file
    assert s3.proxy.count("DeleteObjects") == 5


def _refusing_deletes(env: Any, monkeypatch: pytest.MonkeyPatch, refused: str) -> Callable[[], None]:
    """Make the proxy answer `DeleteObjects` as S3 does where a bucket policy (or object lock) denies some
    keys: 200, the others deleted, an `<Error>` per refused key, which stays."""
    proxy, forward = env.proxy, env.proxy._forward
    ns = "{http://s3.amazonaws.com/doc/2006-03-01/}"

    def answer(method: str, raw_uri: str, headers: dict[str, str], body: bytes) -> Any:
        if method != "POST" or "delete" not in raw_uri.partition("?")[2]:
            return forward(method, raw_uri, headers, body)
        ET.register_namespace("", ns[1:-1])
        doc = ET.fromstring(body)
        kept = [o for o in doc if (o.findtext(f"{ns}Key") or o.findtext("Key") or "").find(refused) >= 0]
        for o in kept:
            doc.remove(o)
        body = ET.tostring(doc)
        headers = {
            k: v for k, v in headers.items() if k != "content-md5" and not k.startswith("x-amz-checksum")
        }
        headers = {k: v for k, v in headers.items() if k != "x-amz-sdk-checksum-algorithm"}
        status, out, data = forward(method, raw_uri, headers, body)
        errors = "".join(
            f"<Error><Key>{o.findtext(f'{ns}Key') or o.findtext('Key')}</Key><Code>AccessDenied</Code>"
            "<Message>Access Denied</Message></Error>"
            for o in kept
        )
        data = data.replace(b"</DeleteResult>", errors.encode() + b"</DeleteResult>")
        out = [(k, v) for k, v in out if k.lower() != "content-length"] + [("Content-Length", str(len(data)))]
        return status, out, data

    monkeypatch.setattr(proxy, "_forward", answer)
    return lambda: monkeypatch.setattr(proxy, "_forward", forward)


def test_a_delete_refused_per_key_inside_a_200_answer_is_an_error_and_the_next_prune_finishes(
    s3,  # noqa: F811
    monkeypatch,
):
    """S3 answers `DeleteObjects` with 200 and an `<Error>` per key it refused: the prune fails, named, and
    does not count the step deleted; the step is left without its manifest (absent to readers) under the
    prune's claim, which the next prune (this process gone) takes over and finishes."""

    put = _putter(s3)

    steps = {s: _step(put, "run", s, ["model.safetensors", "optim.bin"]) for s in (1, 2)}
    stop = _refusing_deletes(s3, monkeypatch, "step-00000001/optim.bin")
    r = run_cli(["prune", s3.url("run"), "--keep-last", "1"])
    assert r.returncode != 0 and "SinkAuthError" in r.stderr, r.stderr  # a missing permission: not retried
    assert "1 of 2 deletes refused" in r.stderr and "s3:DeleteObject" in r.stderr, r.stderr
    assert "AccessDenied" in r.stderr and "pruned" not in r.stdout, (r.stdout, r.stderr)
    left = s3.keys("run/")
    assert "run/step-00000001/optim.bin" in left and f"run/step-00000001/{layout.MANIFEST_NAME}" not in left
    assert set(steps[2]) <= set(left)
    stop()
    r = run_cli(["prune", s3.url("run"), "--keep-last", "1"])
    assert r.returncode == 0, r.stderr
    assert sorted(s3.keys("run/")) == sorted(steps[2])


def test_retention_and_republish_on_a_versioned_bucket(s3, tmp_path):  # noqa: F811
    """On a versioned bucket a delete leaves a delete marker (old versions stay, the bucket's lifecycle
    rules reap them): the conditional requests claims rely on still hold, the pruned step is gone from
    every listing, and it can be published again (its claim and manifest create over delete markers)."""
    s3.client.put_bucket_versioning(Bucket=s3.bucket, VersioningConfiguration={"Status": "Enabled"})
    sink = FsspecSink.from_url(s3.url("run"), part_size=5 * MiB)
    exports = {
        s: make_export(tmp_path / f"e{s}", {"model.safetensors": 1000, "config.json": 20}, seed=s)
        for s in (1, 2, 3)
    }
    for s, e in exports.items():
        sink.publish(e, s)
    fates = _fates(s3.url("run"))
    assert fates == {1: True, 2: True, 3: False}
    assert not [k for k in s3.keys("run/") if re.search(r"step-0000000[12]", k)]
    versions = s3.client.list_object_versions(Bucket=s3.bucket, Prefix="run/step-00000001/")
    assert versions.get("DeleteMarkers")  # what S3 does: the old bytes stay as noncurrent versions
    assert not sink.publish(exports[1], 1).skipped
    assert sink.is_published(1)
    sink.close()


def test_a_restarted_publishers_sweep_aborts_no_upload_outside_its_step(s3, tmp_path):  # noqa: F811
    """Another tool's pending multipart uploads beside the step (`step-N.bak/`, a longer step name, the
    sink's root, a sibling prefix `ckpt10/`) stay; only the killed run's under `ckpt/step-N/` goes."""
    export = make_export(tmp_path / "e", {"a.safetensors": 11 * MiB})
    step = layout.step_dir_name(4)
    ours = s3.client.create_multipart_upload(Bucket=s3.bucket, Key=f"ckpt/{step}/a.safetensors")["UploadId"]
    theirs = {
        k: s3.client.create_multipart_upload(Bucket=s3.bucket, Key=k)["UploadId"]
        for k in (f"ckpt/{step}.bak/a", f"ckpt/{step}0/a", f"ckpt/{step}", "ckpt/README", f"ckpt10/{step}/a")
    }
    claim = publish_claim(export).encode()  # the killed run's claim: the same tree on the same host
    s3.client.put_object(Bucket=s3.bucket, Key=f"ckpt/{claim_key(step)}", Body=claim)
    sink = FsspecSink.from_url(s3.url("ckpt"), part_size=5 * MiB)
    assert not sink.publish(export, 4).skipped
    sink.close()
    pending = {u["UploadId"]: u["Key"] for u in s3.client.list_multipart_uploads(Bucket=s3.bucket)["Uploads"]}
    assert pending == {u: k for k, u in theirs.items()} and ours not in pending


def test_a_generic_stores_delete_of_a_glob_name_is_refused_before_any_is_deleted():
    """`RemoteStore.delete` on a generic fsspec store refuses a batch holding a glob name whole: none of
    its keys is deleted (a half-done batch would leave a step neither whole nor gone)."""
    import fsspec

    fs = fsspec.filesystem("memory")
    root = "/glob-batch"
    try:
        for k in ("s/a", "s/b[1]", "s/c"):
            fs.pipe_file(f"{root}/{k}", b"x")
        store = RemoteStore.open(f"memory://{root}")
        with pytest.raises(SinkError, match="glob"):
            store.delete(["s/a", "s/b[1]", "s/c"])
        assert sorted(fs.find(root)) == [f"{root}/s/a", f"{root}/s/b[1]", f"{root}/s/c"]
    finally:
        fs.rm(root, recursive=True)


def test_a_generic_stores_fleet_record_with_a_glob_name_is_left_with_its_done_record():
    """Orphaned `fleet/step-N/` records go by conditional deletes (`delete_if`): on a generic fsspec store a
    record whose name has glob characters is left, and `done.json` (deleted last) with it."""
    import fsspec

    fs = fsspec.filesystem("memory")
    root = "/glob-records"

    def put(key: str, data: bytes) -> None:
        fs.pipe_file(f"{root}/{key}", data)

    try:
        _step(put, "raw", 2, ["optim.bin"])
        records = {f"fleet/{layout.step_dir_name(1)}/{n}": b"{}" for n in ("done.json", "node [1]*.json")}
        for k, v in records.items():
            put(k, v)
        store = RemoteStore.open(f"memory://{root}")
        fleet = [d for d in prune(store, Policy(keep_last=1)) if d.tree == "fleet"]
        assert [(d.step, d.delete) for d in fleet] == [(1, False)] and "left" in fleet[0].reason
        assert {k: fs.cat_file(f"{root}/{k}") for k in records} == records
    finally:
        fs.rm(root, recursive=True)


def test_published_steps_on_a_generic_fsspec_store_are_pruned(tmp_path):
    """Each published step has its publisher's claim, which a prune replaces only while it is the version
    listed: the tag read back (`info`) must be the listing's (`find`), or no published step ever goes."""
    root = "memory://prune-claims/run"
    sink = FsspecSink.from_url(root)
    try:
        for s in (1, 2, 3):
            sink.publish(make_export(tmp_path / f"e{s}", {"model.safetensors": 100}, seed=s), s)
        store = RemoteStore.open(root)
        fates = {d.step: d.delete for d in prune(store, Policy(keep_last=1)) if d.tree == "export"}
        assert fates == {1: True, 2: True, 3: False}
        assert sorted(store.objects("", start="step-")) == [
            f"step-00000003/{n}" for n in ("model.safetensors", layout.MANIFEST_NAME)
        ]
    finally:
        sink.backend.fs.rm("/prune-claims", recursive=True)


@pytest.mark.parametrize("prefix", ["r%41 +ü", "r%2Fx"])
def test_a_prefix_with_percent_signs_spaces_and_unicode_is_literal(s3, prefix):  # noqa: F811
    """The prefix is a literal key prefix: `r%41` is not `rA`, `r%2Fx` not `r/x`, `+` not a space."""

    put = _putter(s3)

    ours = {s: _step(put, prefix, s, ["model.safetensors", HOSTILE]) for s in (1, 2)}
    others: dict[str, bytes] = {}
    for near in ("rA +ü", "r%41  ü", "r%41 +ü0", "r/x", "r%2Fx0", "r%2fx"):
        for s in (1, 2):  # two steps each: a prune that read the prefix loosely would delete one
            others |= _step(put, near, s, ["model.safetensors"])
    fates = _fates(s3.url(prefix))
    assert fates == {1: True, 2: False}
    left = {k: s3.get(k) for k in s3.keys("")}
    assert left == {**others, **ours[2]}


def test_a_sink_at_the_buckets_root_prunes_only_its_own_steps(s3):  # noqa: F811
    """`s3://BUCKET` with no prefix: its steps are `step-N/` at the bucket's root; every other run's
    prefix in the bucket, and a person's `step-N.bak/`, stay."""

    put = _putter(s3)

    ours = {s: _step(put, "", s, ["model.safetensors"]) for s in (1, 2)}
    others: dict[str, bytes] = {}
    for s in (1, 2):
        others |= _step(put, "run1", s, ["model.safetensors"])
    put("step-00000001.bak/model.safetensors", b"kept")
    others["step-00000001.bak/model.safetensors"] = b"kept"
    fates = _fates(s3.url("").rstrip("/"))
    assert fates == {1: True, 2: False}
    assert {k: s3.get(k) for k in s3.keys("")} == {**others, **ours[2]}


def _fates(url: str) -> dict[int, bool]:
    """Each export step's fate (deleted: True) under a prune of `url` keeping the newest step."""
    store = RemoteStore.open(url)
    try:
        return {d.step: d.delete for d in prune(store, Policy(keep_last=1)) if d.tree == "export"}
    finally:
        store.close()


def _putter(env: Any) -> Callable[[str, bytes], None]:
    """An object put straight to moto, as another tool (or a person) writes it."""

    def put(key: str, data: bytes) -> None:
        env.client.put_object(Bucket=env.bucket, Key=key, Body=data)

    return put
