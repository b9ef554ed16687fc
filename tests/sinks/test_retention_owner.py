"""Two runs (two ROOTs) publishing to one sink prefix, by mistake: each one's remote retention deletes only
the steps its own ROOT published. Before, `--remote-keep-last 1` of run A counted every complete step
under the prefix as its own and deleted run B's checkpoints (RELIABILITY.md, "Data safety"). The stores
are moto S3 and real directories; the publishes are the real sink's.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from stagerd.contract import layout
from stagerd.sinks.claims import claim_key
from stagerd.sinks.fetch import RemoteStore
from stagerd.sinks.fsspec import FsspecSink
from stagerd.sinks.prune import Owner, Policy, prune
from tests.cli_helpers import run_cli
from tests.dcp_fixtures import commit_step
from tests.s3server import s3, s3_server  # noqa: F401  (fixtures)
from tests.sinks.test_sink_fsspec import make_export

SIZES = {"model.safetensors": 3000, "config.json": 200}
A_STEPS, B_STEPS = (1, 3, 5), (2, 4, 6)  # interleaved: B's newest (6) is newer than A's (5)


def _root(path: Path) -> Path:
    (path / layout.STATE_DIR).mkdir(parents=True)  # a daemon's ROOT: its identity is fleet-root-id
    return path


class _Prefix:
    """One sink prefix on S3 or on disk: its URL and every key under it."""

    def __init__(self, request: pytest.FixtureRequest, tmp_path: Path, store: str) -> None:
        if store == "s3":
            env = request.getfixturevalue("s3")
            self.url = env.url("shared")
            self.keys = lambda: set(env.keys("shared/"))
            self.put = lambda k, b: env.client.put_object(Bucket=env.bucket, Key=f"shared/{k}", Body=b)
        else:
            base = tmp_path / "sink"
            self.url = base.as_uri()
            self.keys = lambda: {f"shared/{p.relative_to(base)}" for p in base.rglob("*") if p.is_file()}
            self.put = lambda k, b: (base / k).write_bytes(b)

    def step_keys(self, step: int) -> set[str]:
        name = layout.step_dir_name(step)
        return {k for k in self.keys() if k.startswith(f"shared/{name}/") or k == f"shared/claims/{name}"}


def _publish_both(tmp_path: Path, prefix: _Prefix) -> tuple[Path, Path]:
    a, b = _root(tmp_path / "a"), _root(tmp_path / "b")
    sink = FsspecSink.from_url(prefix.url)
    try:
        for step in sorted(A_STEPS + B_STEPS):
            root = a if step in A_STEPS else b
            export = make_export(root / layout.step_dir_name(step) / layout.EXPORT_DIR, SIZES, seed=step)
            assert not sink.publish(export, step).skipped
    finally:
        sink.close()
    return a, b


@pytest.mark.parametrize("store", ["file", "s3"])
def test_keep_last_1_of_one_root_deletes_only_its_own_older_steps(request, tmp_path, store, caplog):
    """A applies keep-last 1 to a prefix B publishes to as well: every key of B's steps remains, A's newest
    (5) stays although B published 6 since, A's older steps lose every key (and their claims). B's steps
    are logged once each as another ROOT's, not again on the next prune."""
    prefix = _Prefix(request, tmp_path, store)
    a, _ = _publish_both(tmp_path, prefix)
    b_keys = {s: prefix.step_keys(s) for s in B_STEPS}
    assert all(len(keys) == 4 for keys in b_keys.values())  # two files, the manifest, the claim
    remote = RemoteStore.open(prefix.url)
    owner = Owner.of(a)
    try:
        with caplog.at_level("WARNING", logger="stagerd.sinks.prune"):
            fates = {d.step: d.delete for d in prune(remote, Policy(keep_last=1), owner=owner)}
            assert fates == {1: True, 2: False, 3: True, 4: False, 5: False, 6: False}
            again = prune(remote, Policy(keep_last=1), owner=owner)
    finally:
        remote.close()
    assert not any(d.delete for d in again)
    assert {s: prefix.step_keys(s) for s in B_STEPS} == b_keys
    assert prefix.step_keys(1) == prefix.step_keys(3) == set()
    assert len(prefix.step_keys(5)) == 4
    warned = [r for r in caplog.records if "another ROOT" in r.getMessage()]
    assert sorted(r.step for r in warned) == list(B_STEPS), [r.getMessage() for r in warned]  # type: ignore[attr-defined]
    assert all("Hint" in r.getMessage() for r in warned)


@pytest.mark.parametrize("store", ["file", "s3"])
def test_an_older_stagerds_claim_of_this_host_and_path_is_still_pruned(request, tmp_path, store):
    """A's steps 1 and 3 were published by an older stagerd whose claims name host and path but no ROOT
    identity: they are A's (the publisher's own rule: host and path decide), so they still go, and the
    bucket of a user who upgraded does not grow for ever. B's older claim names B's path: left alone."""
    prefix = _Prefix(request, tmp_path, store)
    a, _ = _publish_both(tmp_path, prefix)
    for step in (1, 3, 4):
        key = claim_key(layout.step_dir_name(step))
        remote = RemoteStore.open(prefix.url)
        try:
            older = json.loads(remote.read(key, limit=4096) or b"")
        finally:
            remote.close()
        del older["tree"]
        prefix.put(key, json.dumps(older).encode())
    b_keys = {s: prefix.step_keys(s) for s in B_STEPS}
    remote = RemoteStore.open(prefix.url)
    try:
        fates = {d.step: d.delete for d in prune(remote, Policy(keep_last=1), owner=Owner.of(a))}
    finally:
        remote.close()
    assert fates == {1: True, 2: False, 3: True, 4: False, 5: False, 6: False}
    assert prefix.step_keys(1) == prefix.step_keys(3) == set()
    assert {s: prefix.step_keys(s) for s in B_STEPS} == b_keys


def test_stagerd_prune_shows_each_publisher_and_root_limits_it_to_one(tmp_path):
    """A person's `stagerd prune`: without --root it counts every step as before, and says whose each is
    and that two publishers share the prefix; with --root it deletes only that ROOT's older steps."""
    sink = tmp_path / "sink"
    a, b = _publish_both(tmp_path, _Prefix(None, tmp_path, "file"))  # type: ignore[arg-type]
    r = run_cli(["prune", sink.as_uri(), "--keep-last", "1", "--dry-run"])
    assert r.returncode == 0, r.stderr
    lines = {int(ln.split()[2]): ln for ln in r.stdout.splitlines() if ln.startswith("export")}
    for step in A_STEPS + B_STEPS:
        assert f":{(a if step in A_STEPS else b).resolve()} (id " in lines[step], lines[step]
    assert "would delete" in lines[5] and "2 publishers share this prefix" in r.stdout, r.stdout
    r = run_cli(["prune", sink.as_uri(), "--keep-last", "1", "--root", a])
    assert r.returncode == 0, r.stderr
    steps = sorted(s for p in sink.glob("step-*") if (s := layout.parse_step_dir(p.name)) is not None)
    assert steps == [2, 4, 5, 6], r.stdout


@pytest.mark.slow
def test_two_daemons_on_one_prefix_keep_each_others_steps(tmp_path, dcp_mixed2):
    """`stagerd watch` of two ROOTs, one `--sink`: B's daemon (no retention) published steps 7 and 8, then
    A's daemon, `--remote-keep-last 1`, publishes 1 to 3. Before, A's retention kept only the newest step
    of all (8): it deleted B's 7, its own 1 and 2, and its own newest, 3, too."""
    from tests.daemon_helpers import fast_flags

    sink = tmp_path / "sink"
    for name, steps in (("b", (7, 8)), ("a", (1, 2, 3))):
        root = tmp_path / name
        for s in steps:
            step_dir = root / layout.step_dir_name(s)
            shutil.copytree(dcp_mixed2[0], step_dir / "model")
            commit_step(step_dir, 2)
        keep = ["--remote-keep-last", "1"] if name == "a" else []
        r = run_cli(["watch", root, "--sink", sink.as_uri(), "--once", *keep, *fast_flags()], timeout=180)
        assert r.returncode == 0, r.stderr[-3000:]
    steps = sorted(s for p in sink.glob("step-*") if (s := layout.parse_step_dir(p.name)) is not None)
    assert steps == [3, 7, 8]
    assert "another ROOT" in r.stderr


def test_a_step_whose_publisher_is_not_recorded_is_left_only_where_another_root_publishes():
    """The plan, pure: a step with no publisher recorded (UNKNOWN: a fleet leader's commit) is this ROOT's
    as before where no other ROOT publishes (a single run's bucket still shrinks), and left alone, never
    counted, where one does. Another ROOT's step is never deleted nor counted."""
    from stagerd.sinks.claims import FOREIGN, OWN, UNKNOWN
    from stagerd.sinks.prune_plan import RemoteStep, plan_prune

    owners = {1: UNKNOWN, 2: OWN, 3: UNKNOWN, 4: OWN, 5: FOREIGN}
    steps = [RemoteStep(s, True, owner=o) for s, o in owners.items()]
    alone = {d.step: d.delete for d in plan_prune(steps[:4], Policy(keep_last=1), None, set())}
    assert alone == {1: True, 2: True, 3: True, 4: False}
    shared = {d.step: d.delete for d in plan_prune(steps, Policy(keep_last=1), None, set(), shared=True)}
    assert shared == {1: False, 2: True, 3: False, 4: False, 5: False}  # 4: its own newest
    shared = {d.step: d for d in plan_prune(steps, Policy(keep_last=1), 2, set(), shared=True)}
    assert [s for s, d in shared.items() if d.foreign] == [1, 3, 5]


def test_a_node_locally_staged_raw_step_is_each_of_its_nodes_own(tmp_path):
    """A 2-node fleet's raw step: each node's part is claimed by that node's ROOT, and each node's daemon
    prunes the step (it is its own if one part is). Guards what already held: a fleet's own raw steps
    still go."""
    sink_dir = tmp_path / "sink"
    sink = FsspecSink.from_url(sink_dir.as_uri())
    roots = [_root(tmp_path / f"n{node}") for node in range(2)]
    for s in (1, 2):
        for node, root in enumerate(roots):
            d = root / layout.step_dir_name(s)
            (d / "model").mkdir(parents=True)
            (d / "model" / f"shard-{node}.safetensors").write_bytes(bytes([s, node]) * 100)
            commit_step(d, 2, staging_node=node, staging_nodes=2)
            sink.publish_raw(d, s)
    remote = RemoteStore.open(sink_dir.as_uri())
    try:
        fates = {d.step: d.delete for d in prune(remote, Policy(keep_last=1), owner=Owner.of(roots[1]))}
    finally:
        remote.close()
    assert fates == {1: True, 2: False}
    assert not (sink_dir / "raw" / layout.step_dir_name(1)).exists()


@pytest.mark.parametrize("store", ["file", "s3"])
def test_a_large_fleets_claim_is_read_and_an_oversized_one_stops_no_prune(request, tmp_path, store):
    """A fleet of 128 nodes: the export's claim names 128 ROOTs (4.7 kB). Claims were read 4 kB at most:
    every prune of the prefix then failed (`RestoreError: is larger than 4096 bytes`), for every node. Now
    it is read, and a node of that fleet prunes it as its own; a claim larger than any fleet's reads as
    unreadable, that step alone judged as such, and the prune of the rest goes on."""
    import uuid

    from stagerd.contract.root_id import root_id

    prefix = _Prefix(request, tmp_path, store)
    a, _ = _publish_both(tmp_path, prefix)
    remote = RemoteStore.open(prefix.url)
    try:
        key1 = claim_key(layout.step_dir_name(1))
        fleet = json.loads(remote.read(key1) or b"")
        fleet["trees"] = [root_id(a), *(uuid.uuid4().hex for _ in range(127))]
        prefix.put(key1, json.dumps(fleet).encode())
        key3 = claim_key(layout.step_dir_name(3))
        huge = json.loads(remote.read(key3) or b"")
        huge["trees"] = [uuid.uuid4().hex for _ in range(5000)]
        prefix.put(key3, json.dumps(huge).encode())
        fates = {d.step: d.delete for d in prune(remote, Policy(keep_last=1), owner=Owner.of(a))}
    finally:
        remote.close()
    assert fates[1] is True and fates[3] is False and fates[5] is False
    assert prefix.step_keys(1) == set() and len(prefix.step_keys(3)) == 4
