"""A fleet's exports on a prefix another run publishes to as well, by mistake: each run's remote retention
deletes only its own steps. Before, the fleet leader's commit recorded no publisher: a single-node ROOT
counted the fleet's exports as its own (nothing else there was another ROOT's) and deleted them, and the
fleet's nodes, seeing the other ROOT's steps, never deleted their own older exports again. Now the leader's
claim names every node's ROOT (`claims.fleet_claim`). The nodes are threads running `FleetNode` (each its
own ROOT and identity, on a file:// exchange apart from the sink); the stores are moto S3 and real
directories, the publishes and prunes the real ones.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from stagerd.contract import layout
from stagerd.contract.root_id import root_id
from stagerd.daemon.fleet.node import FleetResult
from stagerd.sinks.claims import claim_key
from stagerd.sinks.fetch import RemoteStore
from stagerd.sinks.fsspec import FsspecSink
from stagerd.sinks.prune import Owner, Policy, prune
from tests.dcp_fixtures import commit_step
from tests.fleet_helpers import fleet_node, run_nodes, split_step
from tests.s3server import s3, s3_server  # noqa: F401  (fixtures)
from tests.sinks.test_retention_owner import _Prefix, _root
from tests.sinks.test_sink_fsspec import make_export

SHARD = 1500  # small output files, so that both nodes own some


class _Fleet:
    """Two node-local ROOTs (a daemon's, each with its own identity) publishing through one exchange."""

    def __init__(self, tmp: Path, name: str) -> None:
        self.tmp, self.name = tmp, name
        self.roots = [_root(tmp / name / f"node{k}") for k in range(2)]
        self.ids = [root_id(r) for r in self.roots]
        self.exchange = (tmp / f"{name}-exchange").as_uri()

    def publish(self, model: Path, url: str, step: int) -> None:
        """Step `step` saved once, its shards dealt over both nodes, exported by both to `url`."""
        whole = self.tmp / f"{self.name}-whole" / layout.step_dir_name(step)
        (whole / "model").mkdir(parents=True)
        (whole / "extras").mkdir()
        (whole / "extras" / "config.json").write_text('{"model_type": "tiny"}')
        shards = sorted(model.glob("*.safetensors"))
        for s in shards:
            shutil.copy(s, whole / "model" / s.name)
        commit_step(whole, len(shards))
        split = split_step(whole, self.tmp / self.name, 2)
        results = run_nodes(
            lambda k: fleet_node(split[k], url, self.exchange, self.ids[k], max_shard_size=SHARD)[0], 2
        )
        assert all(isinstance(r, FleetResult) for r in results), results


def _single(prefix: _Prefix, root: Path, *steps: int) -> None:
    """A single-node ROOT's exports, as its daemon publishes them."""
    sink = FsspecSink.from_url(prefix.url)
    try:
        for s in steps:
            sizes = {"model.safetensors": 3000, "config.json": 200}
            export = make_export(root / layout.step_dir_name(s) / layout.EXPORT_DIR, sizes, seed=s)
            assert not sink.publish(export, s).skipped
    finally:
        sink.close()


def _prune(prefix: _Prefix, root: Path) -> dict[int, bool]:
    """ROOT's daemon's retention, keep-last 1, after a publish: the export tree's fates."""
    remote = RemoteStore.open(prefix.url)
    try:
        decisions = prune(remote, Policy(keep_last=1), owner=Owner.of(root))
    finally:
        remote.close()
    return {d.step: d.delete for d in decisions if d.tree == "export"}


def _keys(prefix: _Prefix, *steps: int) -> dict[int, set[str]]:
    return {s: prefix.step_keys(s) for s in steps}


@pytest.mark.parametrize("store", ["file", "s3"])
def test_a_fleet_and_a_single_root_on_one_prefix_each_prune_only_their_own(
    request, tmp_path, dcp_mixed2, store
):
    """The fleet exports 1, 3 and 5 (step 1 as an older leader committed it: no claim), a single-node
    ROOT 2 and 4. The ROOT's keep-last 1 deletes its own 2 and keeps every key of the fleet's steps; node
    1 of the fleet (not its leader) deletes the fleet's 3 and keeps every key of the ROOT's 4; step 1,
    whose publisher is not recorded, stays UNKNOWN and is left by both, as another ROOT publishes here."""
    prefix = _Prefix(request, tmp_path, store)
    fleet, single = _Fleet(tmp_path, "fleet"), _root(tmp_path / "single")
    for step in (1, 3, 5):
        fleet.publish(dcp_mixed2[0], prefix.url, step)
    _delete(prefix, claim_key(layout.step_dir_name(1)))
    _single(prefix, single, 2, 4)
    fleet_keys = _keys(prefix, 1, 3, 5)
    assert all(len(k) > 3 for k in fleet_keys.values()) and prefix.step_keys(2)

    assert _prune(prefix, single) == {1: False, 2: True, 3: False, 4: False, 5: False}
    assert _keys(prefix, 1, 3, 5) == fleet_keys
    assert prefix.step_keys(2) == set()

    single_keys = prefix.step_keys(4)
    assert _prune(prefix, fleet.roots[1]) == {1: False, 3: True, 4: False, 5: False}
    assert prefix.step_keys(4) == single_keys
    assert prefix.step_keys(3) == set()
    assert _keys(prefix, 1, 5) == {1: fleet_keys[1], 5: fleet_keys[5]}
    claim = json.loads(_read(prefix, claim_key(layout.step_dir_name(5))))
    # an older stagerd reads `tree` alone: the leader's ROOT, so no other ROOT takes the step for its own
    assert (claim["kind"], claim["tree"], claim["trees"]) == ("publish", fleet.ids[0], fleet.ids)


def test_two_fleets_on_one_prefix_each_prune_only_their_own(tmp_path, dcp_mixed2):
    """Fleet A exports 1 and 3, fleet B 2 and 4, to one prefix: a node of A keeping 1 deletes A's 1 alone
    (before, every export was UNKNOWN and it kept only 4, the newest of all); B's leader then deletes
    B's 2 alone; the dry run names each export's leader and its fleet."""
    prefix = _Prefix(request=None, tmp_path=tmp_path, store="file")  # type: ignore[arg-type]
    a, b = _Fleet(tmp_path, "a"), _Fleet(tmp_path, "b")
    for step in (1, 2, 3, 4):
        (a if step % 2 else b).publish(dcp_mixed2[0], prefix.url, step)
    b_keys = _keys(prefix, 2, 4)
    assert _prune(prefix, a.roots[1]) == {1: True, 2: False, 3: False, 4: False}
    assert _keys(prefix, 2, 4) == b_keys and prefix.step_keys(1) == set()
    a_keys = prefix.step_keys(3)
    assert _prune(prefix, b.roots[0]) == {2: True, 3: False, 4: False}
    assert prefix.step_keys(3) == a_keys and prefix.step_keys(2) == set()

    remote = RemoteStore.open(prefix.url)
    try:
        decisions = prune(remote, Policy(keep_last=1), owner=Owner(None), dry_run=True)
    finally:
        remote.close()
    shown = {d.step: d.publisher for d in decisions if d.tree == "export"}
    assert f"(id {a.ids[0][:8]}, a fleet of 2 nodes)" in shown[3], shown
    assert f"(id {b.ids[0][:8]}, a fleet of 2 nodes)" in shown[4], shown


def _read(prefix: _Prefix, key: str) -> bytes:
    remote = RemoteStore.open(prefix.url)
    try:
        data = remote.read(key, limit=4096)
    finally:
        remote.close()
    assert data is not None, key
    return data


def _delete(prefix: _Prefix, key: str) -> None:
    remote = RemoteStore.open(prefix.url)
    try:
        remote.delete([key])
    finally:
        remote.close()
