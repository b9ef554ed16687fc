"""The fsspec sink against the local filesystem and fsspec's memory store (S3: test_sink_s3.py)."""

from __future__ import annotations

import hashlib
import json
import os
import zlib
from pathlib import Path

import pytest

from stagerd.contract import commit_marker, layout
from stagerd.contract.manifest import ExportManifest, ManifestFile
from stagerd.errors import SinkConflictError, SinkError, VerifyError
from stagerd.sinks import PublishResult, Sink, open_sink
from stagerd.sinks.fsspec import FsspecSink
from stagerd.sinks.hashing import composite_checksum, hash_file, raw_checksum
from stagerd.sinks.local import HOST
from stagerd.sinks.objects import RemoteObject, newer_latest, plan_reuse, redact_url, scan_dir, verify_listing


def make_export(root: Path, sizes: dict[str, int], seed: int = 0) -> Path:
    """An export dir of files with deterministic pseudo-random bytes."""
    root.mkdir(parents=True, exist_ok=True)
    for i, (rel, size) in enumerate(sorted(sizes.items())):
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        block = hashlib.sha256(f"{seed}-{i}".encode()).digest() * 2048  # 64 KiB
        data = (block * (size // len(block) + 1))[:size]
        p.write_bytes(data)
    return root


SMALL = {
    "model-00001-of-00002.safetensors": 300_000,
    "model-00002-of-00002.safetensors": 123_457,
    layout.INDEX_NAME: 812,
    "tokenizer/tokenizer.json": 77,
}


def tree_bytes(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


# -- pure parts -------------------------------------------------------------------------------------------


def test_redact_url_hides_passwords_and_secret_params():
    assert redact_url("s3://bucket/prefix") == "s3://bucket/prefix"
    r = redact_url("https://user:hunter2@host/p?X-Amz-Signature=abc&x=1&token=zzz")
    assert "hunter2" not in r and "abc" not in r and "zzz" not in r
    assert "user" in r and "x=1" in r


def test_verify_listing_names_every_problem():
    m = ExportManifest(
        step=3,
        files=(
            ManifestFile("a", 1, "00"),
            ManifestFile("b", 2, "00"),
            ManifestFile("c", 3, "00"),
        ),
    )
    remote = {"a": RemoteObject(1, "X"), "b": RemoteObject(5)}
    problems = verify_listing(m, remote, {"a": "Y"})
    assert problems == ["a: checksum X, expected Y", "b: 5 bytes, expected 2", "c: missing"]
    good = {"a": RemoteObject(1, "Y"), "b": RemoteObject(2), "c": RemoteObject(3)}
    assert verify_listing(m, good, {}) == []


def test_plan_reuse_needs_size_and_checksum(tmp_path):
    files = scan_dir(make_export(tmp_path / "e", {"a": 10, "b": 20, "c": 30}))
    remote = {"a": RemoteObject(10, "x"), "b": RemoteObject(21, "x"), "c": RemoteObject(30)}
    assert [f.rel for f in plan_reuse(files, remote)] == ["a"]


def test_newer_latest_only_moves_forward():
    assert newer_latest(None, 5)
    assert newer_latest(b"step-00000004", 5)
    assert newer_latest(b"step-00000005\n", 5)
    assert not newer_latest(b"step-00000006", 5)
    assert not newer_latest(b"garbage", 5)  # names no step: another tool's object, never overwritten


def test_hash_file_checksums_match_their_definitions(tmp_path):
    import base64

    p = tmp_path / "f"
    data = os.urandom(2_500_000)
    p.write_bytes(data)
    chunks = [data[i : i + 1_000_000] for i in range(0, len(data), 1_000_000)]
    sha = hashlib.sha256(data).hexdigest()

    d = hash_file(p, part_size=1_000_000, algorithm="SHA256")
    assert d.sha256 == sha and d.size == len(data)
    assert d.checksum == composite_checksum([hashlib.sha256(c).digest() for c in chunks], "SHA256")
    assert d.checksum.endswith("-3")
    crc_parts = [zlib.crc32(c).to_bytes(4, "big") for c in chunks]
    expected = base64.b64encode(zlib.crc32(b"".join(crc_parts)).to_bytes(4, "big")).decode() + "-3"
    assert hash_file(p, part_size=1_000_000).checksum == expected

    single = hash_file(p, part_size=5_000_000)
    assert single.sha256 == sha
    assert single.checksum == base64.b64encode(zlib.crc32(data).to_bytes(4, "big")).decode()
    sha_single = hash_file(p, part_size=5_000_000, algorithm="SHA256").checksum
    assert sha_single == base64.b64encode(hashlib.sha256(data).digest()).decode()


@pytest.mark.parametrize("algorithm", ["CRC32", "SHA256"])
def test_reading_parts_hashed_slice_by_slice_gives_each_digest_whole(tmp_path, algorithm):
    """`read_hashed` hashes each MiB as it is read; its digests must equal those of the whole part and
    of the whole file, whatever the sizes: parts and slices of uneven length, a short last part, an
    empty read at the end."""
    import itertools
    import random

    from stagerd.sinks.hashing import HASH_SLICE, read_hashed

    rng = random.Random(7)
    sizes = [0, 1, HASH_SLICE - 1, HASH_SLICE, 3 * HASH_SLICE + 5, rng.randrange(4 * HASH_SLICE)]
    for size, part_size in itertools.product(sizes, [HASH_SLICE // 3, HASH_SLICE, 2 * HASH_SLICE + 1]):
        data = rng.randbytes(size)
        p = tmp_path / f"f{size}"
        p.write_bytes(data)
        buf = bytearray(part_size)
        whole = hashlib.sha256()
        at = 0
        with open(p, "rb", buffering=0) as f:
            while True:
                read = read_hashed(f, buf, algorithm, file_sha256=whole, part_sha256=True)
                part = data[at : at + part_size]
                assert read.size == len(part)
                assert read.checksum == raw_checksum(part, algorithm)
                assert read.sha256 == hashlib.sha256(part).hexdigest()
                assert bytes(buf[: read.size]) == part
                at += read.size
                if not read.size:
                    break
        assert at == size and whole.hexdigest() == hashlib.sha256(data).hexdigest()
    with open(p, "rb", buffering=0) as f:
        assert read_hashed(f, bytearray(8), algorithm).sha256 is None  # not asked for


# -- file:// ---------------------------------------------------------------------------------------------


def test_file_sink_publishes_commits_and_is_idempotent(tmp_path):
    export = make_export(tmp_path / "step-00000007" / "export", SMALL)
    dest = tmp_path / "dest"
    sink = open_sink(f"file://{dest}")
    assert isinstance(sink, Sink) and isinstance(sink, FsspecSink)
    assert not sink.is_published(7)
    seen = []
    res = sink.publish(export, 7, metadata={"run": "r1"}, progress=lambda d, t: seen.append((d, t)))
    assert isinstance(res, PublishResult)
    total = sum(SMALL.values())
    assert (res.files, res.bytes_total, res.bytes_uploaded, res.skipped) == (4, total, total, False)
    assert seen[-1] == (total, total)
    step_dir = dest / "step-00000007"
    got = tree_bytes(step_dir)
    manifest = json.loads(got.pop(layout.MANIFEST_NAME))
    claim = json.loads((dest / "claims" / "step-00000007").read_bytes())  # beside the steps, not in one
    assert claim["kind"] == "publish" and claim["owner"].endswith(str(export))  # the step's one publisher
    assert got == tree_bytes(export)
    assert manifest["format"] == layout.MANIFEST_FORMAT and manifest["metadata"] == {"run": "r1"}
    assert {f["path"]: f["sha256"] for f in manifest["files"]} == {
        k: hashlib.sha256(v).hexdigest() for k, v in got.items()
    }
    assert (dest / "latest").read_text() == "step-00000007"
    assert sink.is_published(7)

    again = sink.publish(export, 7)
    assert again.skipped and again.bytes_uploaded == 0


def test_file_sink_latest_never_goes_back(tmp_path):
    dest = tmp_path / "dest"
    sink = open_sink(str(dest))
    sink.publish(make_export(tmp_path / "e9", {"a": 10}), 9)
    sink.publish(make_export(tmp_path / "e3", {"a": 10}), 3)
    assert (dest / "latest").read_text() == "step-00000009"
    sink.publish(make_export(tmp_path / "e12", {"a": 10}), 12)
    assert (dest / "latest").read_text() == "step-00000012"


def test_file_sink_conflicting_manifest_is_refused_and_kept(tmp_path):
    """A second run publishing into a prefix another run used: told who published the step there (its
    claim's host and ROOT) and to give each run its own prefix."""
    import socket

    dest = tmp_path / "dest"
    sink = open_sink(f"file://{dest}")
    first = tmp_path / "run-one"
    sink.publish(make_export(first / "step-00000005" / "export", SMALL, seed=1), 5)
    before = (dest / "step-00000005" / layout.MANIFEST_NAME).read_bytes()
    with pytest.raises(SinkConflictError) as ei:
        sink.publish(make_export(tmp_path / "run-two" / "step-00000005" / "export", SMALL, seed=2), 5)
    assert "step-00000005" in str(ei.value) and not ei.value.retryable
    assert f"host {socket.gethostname()}, ROOT {os.path.realpath(first)}" in ei.value.message, ei.value
    assert "give each run its own prefix" in (ei.value.hint or ""), ei.value.hint
    assert (dest / "step-00000005" / layout.MANIFEST_NAME).read_bytes() == before


def test_a_claim_names_its_publisher_printable_and_bounded():
    from stagerd.sinks.claims import NAMED_CHARS, Claim, publisher_named

    long = Claim("publish", f"h\x1b[31m:/{'d' * 1000}/step-00000005/export", "h", 1).encode()
    named = publisher_named(long)
    assert named is not None and "\x1b" not in named and len(named) < 2 * NAMED_CHARS + 40, named
    assert publisher_named(Claim("prune", "h:1:abc", "h", 1).encode()) is None
    assert publisher_named(b"not json") is None and publisher_named(None) is None


def test_file_sink_partial_step_is_absent_and_completed(tmp_path):
    """A crash before the manifest: the step is not published; a re-run completes it with one manifest."""
    export = make_export(tmp_path / "e", SMALL)
    dest = tmp_path / "dest"
    partial = dest / "step-00000002"
    partial.mkdir(parents=True)
    (partial / "model-00001-of-00002.safetensors").write_bytes(b"truncated")
    sink = open_sink(f"file://{dest}")
    assert not sink.is_published(2)
    res = sink.publish(export, 2)
    assert not res.skipped and sink.is_published(2)
    got = tree_bytes(partial)
    got.pop(layout.MANIFEST_NAME)
    assert got == tree_bytes(export)


def test_bad_inputs_are_named_errors(tmp_path):
    sink = open_sink(f"file://{tmp_path / 'dest'}")
    with pytest.raises(VerifyError, match="not a directory"):
        sink.publish(tmp_path / "nope", 1)
    (tmp_path / "empty").mkdir()
    with pytest.raises(VerifyError, match="no files"):
        sink.publish(tmp_path / "empty", 1)


def test_unwritable_destination_is_a_sink_error(tmp_path):
    if os.geteuid() == 0:
        target = Path("/proc/stagerd-cannot-write")
    else:
        target = tmp_path / "ro"
        target.mkdir()
        target.chmod(0o500)
    sink = open_sink(f"file://{target}")
    with pytest.raises(SinkError) as ei:
        sink.publish(make_export(tmp_path / "e", {"a": 5}), 1)
    assert str(target) in str(ei.value)


def test_memory_fsspec_store_roundtrip(tmp_path):
    import fsspec

    export = make_export(tmp_path / "e", SMALL)
    sink = FsspecSink.from_url("memory://stagerd-test/ckpt")  # open_sink refuses memory://: not durable
    res = sink.publish(export, 4)
    assert not res.skipped
    fs = fsspec.filesystem("memory")
    for rel, data in tree_bytes(export).items():
        assert fs.cat_file(f"/stagerd-test/ckpt/step-00000004/{rel}") == data
    assert fs.cat_file("/stagerd-test/ckpt/latest") == b"step-00000004"
    assert sink.publish(export, 4).skipped
    fs.rm("/stagerd-test", recursive=True)


def test_publish_raw_step(tmp_path):
    step_dir = tmp_path / "step-00000011"
    make_export(
        step_dir,
        {"model/shard-00001.safetensors": 1000, "optim/__0_0.distcp": 500, "optim/.metadata": 70},
    )
    make_export(step_dir / "export", {"model.safetensors": 900})
    marker = commit_marker.CommitMarker(
        step=11,
        world_size=1,
        files=(
            commit_marker.StagedFile("model/shard-00001.safetensors", 1000),
            commit_marker.StagedFile("optim/__0_0.distcp", 500),
            # a dot file, not a temp file: listed and verified
            commit_marker.StagedFile("optim/.metadata", 70),
        ),
    )
    commit_marker.write_marker(step_dir, marker)
    (step_dir / "export.options.json").write_text("{}")  # the daemon's, never published raw
    dest = tmp_path / "dest"
    sink = FsspecSink.from_url(f"file://{dest}")
    res = sink.publish_raw(step_dir, 11)
    assert res.files == 4 and not res.skipped
    raw = dest / "raw" / "step-00000011"
    assert (raw / layout.MARKER_NAME).exists() and (raw / "optim/__0_0.distcp").stat().st_size == 500
    assert not (raw / "export").exists() and not (raw / "export.options.json").exists()
    assert (dest / "raw" / "latest").read_text() == "step-00000011"
    assert not (dest / "latest").exists()
    assert sink.publish_raw(step_dir, 11).skipped


_RAW_UNDER_A_LOW_SOFT_LIMIT = """
import resource, sys
from pathlib import Path
from stagerd.sinks.fsspec import FsspecSink
resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
print(FsspecSink.from_url(Path(sys.argv[2]).as_uri()).publish_raw(Path(sys.argv[1]), 1).files)
"""


def test_a_raw_step_of_more_files_than_the_soft_descriptor_limit_is_published(tmp_path):
    """The raw lane holds every listed file open until the publish ends (so that a link swapped in leads
    no read elsewhere): a step of 300 files under a soft RLIMIT_NOFILE of 256 (the hard one higher, as it
    usually is) failed with `Too many open files`. Now the first held files raise the soft limit to the
    hard one. (Guard against the held reads: it passed when each file was opened by name as it was read.)"""
    import resource
    import subprocess
    import sys

    if resource.getrlimit(resource.RLIMIT_NOFILE)[1] < 1024:
        pytest.skip("a hard RLIMIT_NOFILE under 1024 leaves no room to raise")
    step_dir = tmp_path / "step-00000001"
    rels = sorted(f"{kind}/__{r}_0.distcp" for kind in ("model", "optim") for r in range(150))
    make_export(step_dir, dict.fromkeys(rels, 64))
    listed = tuple(commit_marker.StagedFile(rel, 64) for rel in rels)
    commit_marker.write_marker(step_dir, commit_marker.CommitMarker(step=1, world_size=150, files=listed))
    cmd = [sys.executable, "-c", _RAW_UNDER_A_LOW_SOFT_LIMIT, str(step_dir), str(tmp_path / "sink")]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 0 and r.stdout.strip() == "301", r.stderr[-600:]


def test_raw_latest_waits_for_every_staging_nodes_part(tmp_path):
    """A node-locally staged step is restorable only once every node's part is up. Before the fix the
    first node's part moved `raw/latest`, so `restore --step latest` failed ("not every staging node's")
    while the step before was whole, and stayed so for good if the other node never published."""
    from stagerd.sinks.fetch import RemoteStore, resolve_step
    from tests.dcp_fixtures import commit_step

    dest = tmp_path / "dest"
    sink = FsspecSink.from_url(dest.as_uri())

    def part(step: int, node: int) -> Path:
        d = tmp_path / f"n{node}" / layout.step_dir_name(step)
        (d / "model").mkdir(parents=True)
        (d / "model" / f"shard-{node}.safetensors").write_bytes(bytes([step, node]) * 100)
        commit_step(d, 2, staging_node=node, staging_nodes=2)
        return d

    latest = dest / "raw" / "latest"
    sink.publish_raw(part(1, 1), 1)
    assert not latest.exists()
    sink.publish_raw(part(1, 0), 1)
    assert latest.read_text() == "step-00000001"
    first = part(2, 0)
    sink.publish_raw(first, 2)
    store = RemoteStore.open(dest.as_uri())
    assert resolve_step(store, None, raw=True) == 1
    assert sink.publish_raw(first, 2).skipped  # a re-run: still 1
    assert latest.read_text() == "step-00000001"
    sink.publish_raw(part(2, 1), 2)
    assert resolve_step(store, None, raw=True) == 2
    store.close()


def test_latest_never_moves_back_when_two_steps_publish_at_once_on_a_file_sink(tmp_path):
    """`publish_workers` 2 (or two daemons) on one file:// sink: step 5 read `latest` (absent) and is slow
    to write it; step 10 publishes meanwhile. Before the fix step 5's write landed last: `latest` named
    step 5, behind a published step 10."""
    import threading

    from stagerd.sinks.local import LocalBackend

    reached, release = threading.Event(), threading.Event()

    class SlowLatest(LocalBackend):
        def write(self, key: str, data: bytes) -> None:
            if data == b"step-00000005":
                reached.set()
                release.wait(5)
            super().write(key, data)

    dest = tmp_path / "dest"
    slow = FsspecSink(dest.as_uri(), SlowLatest(dest))
    fast = FsspecSink.from_url(dest.as_uri())
    a = threading.Thread(target=slow.publish, args=(make_export(tmp_path / "a", {"m": 10}), 5))
    a.start()
    assert reached.wait(10)
    b = threading.Thread(target=fast.publish, args=(make_export(tmp_path / "b", {"m": 20}), 10))
    b.start()
    b.join(0.5)  # before the fix it ends here; after it, it waits for step 5's write of `latest`
    release.set()
    a.join(10)
    b.join(10)
    assert (dest / "latest").read_text() == "step-00000010"
    assert (dest / "step-00000005" / layout.MANIFEST_NAME).exists()


def test_a_file_sink_sweeps_only_its_own_temp_files_beside_latest(tmp_path):
    """The sink directory may hold other tools' files. Before the fix every publish unlinked any
    `.NAME.tmp-PID` there whose pid was not alive on this host: another program's temp file, or one being
    written from another host over NFS."""
    dest = tmp_path / "dest"
    dest.mkdir()
    other = dest / ".notes.txt.tmp-999999999"
    other.write_text("another tool's")
    killed = dest / f".latest.tmp-{HOST}-999999999-1"  # a killed stagerd's write of `latest` on this host
    killed.write_text("step-")
    FsspecSink.from_url(dest.as_uri()).publish(make_export(tmp_path / "e", {"m": 10}), 1)
    assert other.read_text() == "another tool's"
    assert not killed.exists()
