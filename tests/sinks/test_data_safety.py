"""Nothing deletes or overwrites outside its own step and literal prefix: glob characters in a sink URL,
two publishers of one step, a prune against a publish, two prunes, restore leases across clocks, and a
fleet's raw parts under remote retention. Each test reproduces a red-team finding on the code before the
fix (RELIABILITY.md, "Data safety"); the stores are moto S3 through the fault proxy and real directories.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from stagerd.contract import layout
from stagerd.errors import SinkConflictError, SinkError
from stagerd.sinks.fetch import RemoteStore
from stagerd.sinks.fsspec import FsspecSink
from stagerd.sinks.local import LocalBackend
from stagerd.sinks.s3.backend import S3Backend
from tests.cli_helpers import run_cli
from tests.dcp_fixtures import commit_step
from tests.s3server import s3, s3_server  # noqa: F401  (fixtures)
from tests.sinks.test_sink_fsspec import make_export, tree_bytes

MiB = 1 << 20


def _valid(sink_dir: Path) -> None:
    """No manifest whose files are gone or other than it says: what a reader must never see."""
    import hashlib

    for m in sink_dir.rglob(layout.MANIFEST_NAME):
        for f in json.loads(m.read_text())["files"]:
            data = (m.parent / f["path"]).read_bytes()
            assert hashlib.sha256(data).hexdigest() == f["sha256"], (m, f["path"])


def _steps(base: Path) -> list[int]:
    return sorted(s for p in base.glob("step-*") if (s := layout.parse_step_dir(p.name)) is not None)


# -- F1: glob characters ---------------------------------------------------------------------------------


def test_a_prefix_with_glob_characters_is_refused_and_other_runs_keep_every_step(s3, tmp_path):  # noqa: F811
    """Steps uploaded to `run*`, `run1`, `run10`, `run2`, `runX` (by an older stagerd or another tool):
    pruning, restoring from or watching into the pattern-like prefix is a ConfigError naming the
    characters, and no object of any prefix is touched."""
    for prefix in ("run*", "run1", "run10", "run2", "runX"):
        for step in (1, 2, 3, 4, 5):
            base = f"{prefix}/{layout.step_dir_name(step)}"
            manifest = {"format": layout.MANIFEST_FORMAT, "step": step, "files": [], "metadata": {}}
            s3.client.put_object(Bucket=s3.bucket, Key=f"{base}/model.safetensors", Body=b"w" * 10)
            s3.client.put_object(
                Bucket=s3.bucket, Key=f"{base}/{layout.MANIFEST_NAME}", Body=json.dumps(manifest)
            )
        s3.client.put_object(Bucket=s3.bucket, Key=f"{prefix}/latest", Body=layout.step_dir_name(5).encode())
    before = s3.keys("")
    r = run_cli(["prune", s3.url("run*"), "--keep-last", "4"])
    assert r.returncode == 2 and "ConfigError" in r.stderr and "glob" in r.stderr, r.stderr
    r = run_cli(["restore", s3.url("run*"), tmp_path / "root", "--step", "1"])
    assert r.returncode == 2 and "ConfigError" in r.stderr and "glob" in r.stderr, r.stderr
    r = run_cli(["watch", tmp_path / "root", "--sink", s3.url("exp[1]"), "--remote-keep-last", "2", "--once"])
    assert r.returncode == 2 and "ConfigError" in r.stderr and "glob" in r.stderr, r.stderr
    assert s3.keys("") == before
    assert not (tmp_path / "root" / layout.step_dir_name(1)).exists()


def test_a_file_sink_path_with_glob_characters_is_taken_literally(tmp_path):
    """A local directory may be named `run*`: every delete is an exact `os` call, so `run1` is untouched."""
    for name in ("run*", "run1"):
        sink = FsspecSink.from_url(f"file://{tmp_path / name}")  # as typed: as_uri() would quote the *
        for step in (1, 2, 3):
            sink.publish(make_export(tmp_path / f"e-{name}-{step}", {"a.safetensors": 100}, seed=step), step)
    r = run_cli(["prune", f"file://{tmp_path / 'run*'}", "--keep-last", "1"])
    assert r.returncode == 0, r.stderr
    assert _steps(tmp_path / "run*") == [3] and _steps(tmp_path / "run1") == [1, 2, 3]


# -- F2: two publishers of one step --------------------------------------------------------------------


class _Held:
    """Real backends that stop until released: before uploading (a publisher that opened its step and is
    slow), or (`at_commit`) with every file uploaded and verified, before the manifest."""

    opened: threading.Event
    release: threading.Event
    at_commit = False

    def _hold(self) -> None:
        self.opened.set()
        assert self.release.wait(60)

    def upload(self, prefix: str, files: Any, progress: Any) -> Any:
        if not self.at_commit:
            self._hold()
        return super().upload(prefix, files, progress)  # type: ignore[misc]

    def create(self, key: str, data: bytes) -> bool:
        if self.at_commit and key.endswith(layout.MANIFEST_NAME):
            self._hold()
        return super().create(key, data)  # type: ignore[misc]


class _HeldS3(_Held, S3Backend):
    pass


class _HeldLocal(_Held, LocalBackend):
    pass


def _held_sink(url: str, *, at_commit: bool = False) -> tuple[FsspecSink, _Held]:
    real = FsspecSink.from_url(url, part_size=5 * MiB, max_concurrency=4)._backend
    if isinstance(real, S3Backend):
        held: Any = _HeldS3(real.fs, real.bucket, real.root, real.part_size, real.max_concurrency)
    else:
        held = _HeldLocal(real.root)
    held.opened, held.release, held.at_commit = threading.Event(), threading.Event(), at_commit
    return FsspecSink(url, held), held


@pytest.mark.parametrize("store", ["s3", "file"])
def test_two_publishers_of_one_step_end_with_one_winner_whose_manifest_is_the_bytes(request, tmp_path, store):
    """Y opens step 7 first and is slow; X, with other weights of the same shapes (and one more file),
    publishes the same step meanwhile. X must lose without changing anything Y writes: before the fix X
    committed, then Y's multipart upload overwrote X's model file under X's manifest."""
    if store == "s3":
        env = request.getfixturevalue("s3")
        url = env.url("race")
    else:
        url = (tmp_path / "sink").as_uri()
    sizes = {"model.safetensors": 11 * MiB, "config.json": 300}
    y_export = make_export(tmp_path / "y", sizes, seed=1)
    x_export = make_export(tmp_path / "x", {**sizes, "extra.json": 50}, seed=2)
    y_sink, held = _held_sink(url)
    outcome: dict[str, Any] = {}

    def y() -> None:
        try:
            outcome["y"] = y_sink.publish(y_export, 7)
        except Exception as e:  # reported below
            outcome["y"] = e

    t = threading.Thread(target=y)
    t.start()
    assert held.opened.wait(60)
    x_sink = FsspecSink.from_url(url, part_size=5 * MiB, max_concurrency=4)
    try:
        with pytest.raises(SinkError) as first:
            x_sink.publish(x_export, 7)
    finally:
        held.release.set()
        t.join(60)
    assert type(first.value).__name__ == "StepClaimedError" and first.value.retryable, first.value
    assert not isinstance(outcome["y"], Exception), outcome["y"]
    with pytest.raises(SinkConflictError):  # once Y committed: X is told its files differ
        x_sink.publish(x_export, 7)
    store_ = RemoteStore.open(url)
    try:
        got = {rel: store_.read(f"step-00000007/{rel}") for rel in store_.sizes("step-00000007")}
    finally:
        store_.close()
    manifest = json.loads(got.pop(layout.MANIFEST_NAME))
    assert got == tree_bytes(y_export)  # the winner's bytes, and nothing of X's (its stray went again)
    import hashlib

    assert {f["path"]: f["sha256"] for f in manifest["files"]} == {
        k: hashlib.sha256(v).hexdigest() for k, v in got.items()
    }


# -- prunes against publishes and prunes -----------------------------------------------------------------


def _publish_all(sink_dir: Path, work: Path, steps: range) -> None:
    sink = FsspecSink.from_url(sink_dir.as_uri())
    for s in steps:
        d = work / layout.step_dir_name(s)
        (d / "model").mkdir(parents=True)
        (d / "model" / "shard.safetensors").write_bytes(bytes([s]) * 1000)
        commit_step(d, 1)
        sink.publish_raw(d, s)
        sink.publish(make_export(work / f"export-{s}", {"model.safetensors": 500}, seed=s), s)


def test_a_killed_prunes_step_is_never_taken_for_leftovers_while_it_is_republished(tmp_path):
    """A prune killed after deleting step 1's manifest, then step 1 published again (its journal lost),
    slowly, while another prune runs: before the fix that prune took the upload, verified and about to be
    committed, for the killed prune's leftovers and deleted it, then the manifest named files now gone.
    Now the publisher finds the prune's claim, writes nothing and is told to wait; the next prune finishes
    the step, and the publish after it succeeds."""
    sink_dir = tmp_path / "sink"
    _publish_all(sink_dir, tmp_path / "work", range(1, 4))
    r = run_cli(
        ["prune", sink_dir.as_uri(), "--keep-last", "1"], env={"STAGERD_CRASH_AT": "prune.manifest:1"}
    )
    assert r.returncode == -9, r.stderr
    assert not (sink_dir / "step-00000001" / layout.MANIFEST_NAME).exists()
    export = tmp_path / "work" / "export-1"
    slow, held = _held_sink(sink_dir.as_uri(), at_commit=True)
    outcome: dict[str, Any] = {}
    t = threading.Thread(target=lambda: outcome.update(r=_try(slow.publish, export, 1)))
    t.start()
    while not held.opened.is_set() and t.is_alive():  # before the fix: under way; after it: refused
        time.sleep(0.01)
    r = run_cli(["prune", sink_dir.as_uri(), "--keep-last", "1"])
    held.release.set()
    t.join(60)
    assert r.returncode == 0, r.stderr
    _valid(sink_dir)
    assert type(outcome["r"]).__name__ == "StepClaimedError", outcome["r"]
    assert "a prune" in str(outcome["r"])
    assert not (sink_dir / "step-00000001").exists()  # finished by the second prune
    assert not FsspecSink.from_url(sink_dir.as_uri()).publish(export, 1).skipped  # and free again
    _valid(sink_dir)


def _try(fn: Any, *args: Any) -> Any:
    try:
        return fn(*args)
    except Exception as e:
        return e


def test_two_prunes_at_once_delete_each_step_once_and_count_it_once(tmp_path):
    from stagerd.sinks.prune import Policy, prune

    sink_dir = tmp_path / "sink"
    _publish_all(sink_dir, tmp_path / "work", range(1, 7))
    gate = threading.Barrier(2)
    counts: list[int] = []

    def one() -> None:
        store = RemoteStore.open(sink_dir.as_uri())
        gate.wait()
        counts.append(sum(d.delete for d in prune(store, Policy(keep_last=1))))
        store.close()

    threads = [threading.Thread(target=one) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sum(counts) == 10, counts  # steps 1-5 of both trees, each counted by exactly one prune
    assert _steps(sink_dir) == [6] and _steps(sink_dir / "raw") == [6]
    _valid(sink_dir)


def test_a_prune_acting_on_a_stale_listing_counts_and_deletes_nothing(tmp_path):
    """The interleaving behind the race above, made certain: prune B lists the steps, prune A deletes
    steps 1 and 2 and gives their claims back, step 2 is published again, then B lists the claims. B finds
    step 1's claim free and takes it: it must see the step gone, count nothing and leave no claim. It takes
    the new publish's claim of step 2 from the listing: it must not delete that publish."""
    from stagerd.sinks.prune import Policy, Tree, _by_step, delete_step, prune

    sink_dir = tmp_path / "sink"
    _publish_all(sink_dir, tmp_path / "work", range(1, 4))
    b = RemoteStore.open(sink_dir.as_uri())
    stale = Tree("export", "")
    stale.steps = _by_step(b.objects("", start="step-"))
    a = RemoteStore.open(sink_dir.as_uri())
    assert sum(d.delete for d in prune(a, Policy(keep_last=1))) == 4  # steps 1-2 of both trees
    FsspecSink.from_url(sink_dir.as_uri()).publish(make_export(tmp_path / "again", {"a": 3}), 2)
    claim2 = (sink_dir / "claims" / "step-00000002").read_bytes()
    stale.claims = b.objects("claims", start="step-")
    assert delete_step(b, stale, 1, b.clock()) is False
    assert not (sink_dir / "claims" / "step-00000001").exists()
    assert delete_step(b, stale, 2, b.clock()) is False
    assert (sink_dir / "step-00000002" / layout.MANIFEST_NAME).is_file()
    assert (sink_dir / "claims" / "step-00000002").read_bytes() == claim2  # the publisher's, put back
    _valid(sink_dir)
    a.close()
    b.close()


def test_restore_leases_are_judged_on_the_stores_clock_and_renewed(tmp_path):
    """A lease from a restorer whose clock is 10 h behind still protects its step (its file is new on the
    sink's clock), and one the store last saw an hour ago does not, whatever its content says; a held
    lease is written again while the restore runs, and its empty directory goes with it."""
    from stagerd.sinks.prune import Lease, Policy, prune

    sink_dir = tmp_path / "sink"
    _publish_all(sink_dir, tmp_path / "work", range(1, 5))
    leases = sink_dir / "restoring"
    leases.mkdir()
    (leases / "step-00000002.skewed").write_text(json.dumps({"started": time.time() - 36000}))
    stale = leases / "step-00000003.killed"
    stale.write_text(json.dumps({"started": time.time()}))
    os.utime(stale, (time.time() - 3600, time.time() - 3600))
    store = RemoteStore.open(sink_dir.as_uri())
    fates = {(d.tree, d.step): d.delete for d in prune(store, Policy(keep_last=1))}
    assert fates[("export", 2)] is False and fates[("raw", 2)] is False
    assert fates[("export", 3)] is True and fates[("export", 1)] is True
    (leases / "step-00000002.skewed").unlink()
    stale.unlink()
    with Lease(store, 4, renew=0.05) as lease:
        first = os.stat(sink_dir / lease.key).st_mtime_ns
        deadline = time.monotonic() + 10
        while os.stat(sink_dir / lease.key).st_mtime_ns == first and time.monotonic() < deadline:
            time.sleep(0.02)
        assert os.stat(sink_dir / lease.key).st_mtime_ns != first, "the lease was not renewed"
    assert not leases.exists()
    store.close()


def _node_parts(tmp_path: Path, steps: tuple[int, ...]) -> Path:
    """A file:// sink holding node-local raw `steps`, each staged on 2 nodes and published by both."""
    sink_dir = tmp_path / "sink"
    sink = FsspecSink.from_url(sink_dir.as_uri())
    for s in steps:
        for node in range(2):
            d = tmp_path / f"n{node}" / layout.step_dir_name(s)
            (d / "model").mkdir(parents=True)
            (d / "model" / f"shard-{node}.safetensors").write_bytes(bytes([s, node]) * 100)
            commit_step(d, 2, staging_node=node, staging_nodes=2)
            sink.publish_raw(d, s)
    return sink_dir


def _fleet_steps(tmp_path: Path, steps: tuple[int, ...]) -> tuple[Path, Path]:
    """`_node_parts` with the records of a finished fleet build for each step, and for step 0 (gone)."""
    sink_dir = _node_parts(tmp_path, steps)
    for s in (0, *steps):
        records = sink_dir / "fleet" / layout.step_dir_name(s)
        records.mkdir(parents=True)
        for name in ("node-00000.json", "node-00001.json", "done.json"):
            (records / name).write_text("{}")
    return sink_dir, sink_dir / "fleet"


def test_a_fleets_raw_parts_stay_until_its_build_is_done_and_go_with_its_records(tmp_path):
    """Node-local raw steps 1-3, each with its fleet records: step 2's build has not recorded that it is
    done, so its parts stay however old; step 1's go, with `fleet/step-1/`; records whose raw step is gone
    (step 0) go once done. Before the fix step 2's parts were deleted under the build, and `fleet/` only
    grew."""
    from stagerd.sinks.prune import Policy, prune

    sink_dir = _node_parts(tmp_path, (1, 2, 3))
    fleet = sink_dir / "fleet"
    for s, done in ((0, True), (1, True), (2, False), (3, False)):
        (fleet / layout.step_dir_name(s) / "done" / "abc").mkdir(parents=True)
        (fleet / layout.step_dir_name(s) / "node-00000.json").write_text("{}")
        (fleet / layout.step_dir_name(s) / "done" / "abc" / "f.json").write_text("{}")
        if done:
            (fleet / layout.step_dir_name(s) / "done.json").write_text("{}")
    store = RemoteStore.open(sink_dir.as_uri())
    decisions = prune(store, Policy(keep_last=1))
    store.close()
    assert _steps(sink_dir / "raw") == [2, 3]
    assert _steps(fleet) == [2, 3]
    why = {(d.tree, d.step): d.reason for d in decisions}
    assert "fleet build" in why[("raw", 2)]


def test_fleet_records_written_since_the_listing_are_never_deleted(tmp_path):
    """A prune lists raw steps 1-2 and the fleet records of steps 0-2 (step 0's raw step is gone); then a
    build of step 0 saved again rewrites its node record, and one of step 1's changes too. The prune must
    delete neither rewritten record, nor `done.json` beside it, nor step 1's raw parts; an unchanged
    record set still goes. Before, both were deleted by the keys listed, whatever they held by then."""
    from stagerd.sinks.prune import Policy, Tree, _by_step, _orphan_records, delete_step, prune, scan

    sink_dir, fleet = _fleet_steps(tmp_path, (1, 2))
    store = RemoteStore.open(sink_dir.as_uri())
    raw = Tree("raw", "raw/")
    raw.steps = _by_step(store.objects("raw", start="step-"))
    raw.claims = store.objects("raw/claims", start="step-")
    listed = _by_step(store.objects("fleet", start="step-"))
    steps, _latest = scan(store, raw, listed, store.clock())
    new_save = json.dumps({"save": "sha256:" + "1" * 64})
    for s in (0, 1):
        (fleet / layout.step_dir_name(s) / "node-00001.json").write_text(new_save)

    (orphan,) = _orphan_records(store, listed, raw, steps, dry_run=False)
    assert orphan.step == 0 and not orphan.delete and "changed" in orphan.reason
    assert (fleet / layout.step_dir_name(0) / "node-00001.json").read_text() == new_save
    assert (fleet / layout.step_dir_name(0) / "done.json").is_file()
    claims_before = {p.name: p.read_bytes() for p in (sink_dir / "raw" / "claims").iterdir()}
    assert delete_step(store, raw, 1, store.clock(), listed[1]) is False
    assert (fleet / layout.step_dir_name(1) / "node-00001.json").read_text() == new_save
    assert _steps(sink_dir / "raw") == [1, 2]
    assert {p.name: p.read_bytes() for p in (sink_dir / "raw" / "claims").iterdir()} == claims_before

    (fleet / layout.step_dir_name(1) / "node-00001.json").write_text("{}")  # the same bytes, a new version
    fates = {(d.tree, d.step): d.delete for d in prune(store, Policy(keep_last=1))}
    assert fates[("raw", 1)] is True and _steps(sink_dir / "raw") == [2]
    assert _steps(fleet) == [2]  # step 0's records, judged afresh on a listing that has them all, go too
    store.close()
