"""A fleet step that a try of an older build committed on one sink only, resumed by nodes whose plan names
other files: the previous build planned a fleet's files at 50GB where no --exchange was given, this one at
5GB, so a model between the two was one file then and several now. The sink that holds the step complete
is never written into again (its manifest lists the old plan's files, which stay the export there); the
other sink gets this build's plan.

The old try's state is made at test scale: the nodes run once with a shard size that makes one file of
the model (the old default, for a model below it), the second sink failing, then again with a small one
(the new default, for a model above it). What that try leaves on the exchange and the sink (the
`claimed/` record, `done/` records, the sink's claim and manifest) is in the same formats in both builds;
its nodes' claims are made the previous build's (no `protocol`, no `stagerd`)."""

from __future__ import annotations

import json

from stagerd.contract import layout
from stagerd.daemon.fleet.node import FleetNode, FleetOptions
from stagerd.sinks.fetch import RemoteStore
from stagerd.sinks.fsspec import FsspecSink
from tests.daemon.fleet.test_protocol import SHARD, STEP, _stage
from tests.fleet_helpers import run_nodes

ONE_FILE = 1 << 30


def _run(node_dirs, tmp_path, urls, shard):
    def node(k: int) -> FleetNode:
        sinks = [FsspecSink.from_url(u) for u in urls]
        opts = FleetOptions(max_shard_size=shard, wait_seconds=5, poll_seconds=0.05)
        ex, store = FsspecSink.from_url(urls[0]), RemoteStore.open(urls[0])
        return FleetNode(node_dirs[k], tmp_path / f"w{k}", sinks, ex, store, str(k), opts)

    return run_nodes(node, len(node_dirs))


def test_a_sink_committed_under_the_old_plan_is_not_written_into(tmp_path, dcp_mixed2):
    _, node_dirs = _stage(tmp_path, dcp_mixed2[0], 2)
    (tmp_path / "b").symlink_to(tmp_path / "mnt" / "b")  # not mounted: every write fails
    urls = [(tmp_path / s).as_uri() for s in ("a", "b")]
    a, b = tmp_path / "a" / layout.step_dir_name(STEP), tmp_path / "b" / layout.step_dir_name(STEP)
    old = _run(node_dirs, tmp_path, urls, ONE_FILE)
    assert (a / layout.MANIFEST_NAME).is_file(), old
    claims = sorted((tmp_path / "a" / "fleet" / layout.step_dir_name(STEP)).glob("node-*.json"))
    assert len(claims) == 2, claims
    for claim in claims:
        body = json.loads(claim.read_text())
        assert body.pop("protocol") and body.pop("stagerd"), body
        claim.write_text(json.dumps(body))
    before = {p.name: p.read_bytes() for p in a.iterdir()}
    assert "model.safetensors" in before

    # healed; every node restarted on the new build, every sink its run's
    (tmp_path / "mnt" / "b").mkdir(parents=True)
    out = _run(node_dirs, tmp_path, urls, SHARD)
    assert all(getattr(r, "failed", None) == {} for r in out), out
    assert {p.name: p.read_bytes() for p in a.iterdir()} == before  # not one file added
    got = sorted(p.name for p in b.iterdir())
    assert layout.INDEX_NAME in got and len([n for n in got if n.startswith("model-")]) > 1, got
    assert (b / layout.MANIFEST_NAME).is_file()
