"""A node stopped by an error no retry mends quarantines the step on every node at once, by name, rather
than leaving the others waiting for it for as long as their daemons run: one whose own staged step cannot
be sent (one rank's shard missing from its ROOT, or torn; two real daemons, one per node-local ROOT, on the
S3 test server: once the shard is back and each node retries, the step publishes the single-node export),
and a leader that refuses a file built from another plan."""

from __future__ import annotations

import json
import shutil
import threading

from stagerd.contract import commit_marker, layout
from stagerd.daemon.fleet.version import build
from stagerd.daemon.journal import Journal
from stagerd.errors import ConfigError
from tests.cli_helpers import run_cli
from tests.daemon.fleet.test_daemon import _done, _single, _watch
from tests.daemon.fleet.test_protocol import STEP, _keys, _node, _stage, _tree
from tests.fleet_helpers import run_nodes
from tests.s3server import s3, s3_server  # noqa: F401  (fixtures)


def _row(root):
    j = Journal.open_readonly(root)
    try:
        (row,) = j.steps()
    finally:
        j.close()
    return row


def test_a_node_missing_a_shard_quarantines_the_step_on_every_node_then_a_retry_publishes_it(
    tmp_path,
    dcp_mixed2,
    s3,  # noqa: F811
):
    shared, node_dirs = _stage(tmp_path, dcp_mixed2[0], 2)
    single = _single(shared, s3)
    shard = sorted((node_dirs[1] / "model").glob("*.safetensors"))[0]
    kept = tmp_path / "kept"
    shutil.move(shard, kept)  # one rank's shard gone from node 1's ROOT
    url = s3.url("fleet")
    # a wait long enough that node 0 timing out would be FleetWaitError, never the quarantine asserted
    procs = [_watch(d.parent, url, "--fleet-wait-seconds", "8") for d in node_dirs]
    (rc0, log0), (rc1, log1) = [_done(p) for p in procs]
    assert rc1 != 0 and (_row(node_dirs[1].parent).state, _row(node_dirs[1].parent).error_class) == (
        "quarantined",
        "ShardError",
    ), log1
    row = _row(node_dirs[0].parent)
    assert rc0 != 0 and (row.state, row.error_class) == ("quarantined", "ShardError"), log0
    assert "node 1 stopped, no retry mends it" in (row.error_message or "") and shard.name in (
        row.error_message or ""
    ), row.error_message
    assert not [k for k in _keys(s3) if k.startswith(f"fleet/{layout.step_dir_name(STEP)}/")]

    shutil.move(kept, shard)  # mended: node 1 retries first, as the hint says, then node 0
    for d in reversed(node_dirs):
        retried = run_cli(["retry", d.parent, "--step", str(STEP)])
        assert retried.returncode == 0, retried.stderr
    procs = [_watch(d.parent, url) for d in node_dirs]
    for p in procs:
        rc, log = _done(p)
        assert rc == 0, log
    assert _tree(_keys(s3), s3, "fleet") == single


def test_a_leader_refusing_another_plans_file_stops_the_node_waiting_for_its_commit(tmp_path, dcp_mixed2):
    """Claims that name no settings (any plan difference they do not name), node 1 building fp16 where
    node 0 plans bf16: the leader refuses node 1's files (ConfigError, quarantined), and node 1, waiting
    for its commit, used to wait again for as long as its daemon ran, saying only "waiting for the
    leader"."""
    _, node_dirs = _stage(tmp_path, dcp_mixed2[0], 2)
    sink = tmp_path / "sink"
    (sink / "fleet" / layout.step_dir_name(STEP)).mkdir(parents=True)
    for k, d in enumerate(node_dirs):  # claims of this build with no settings to compare
        claim = {"root": str(d.parent), "node": k, "nodes": 2, "save": commit_marker.marker_identity(d)}
        key = sink / "fleet" / layout.step_dir_name(STEP) / f"node-{k:05d}.json"
        key.write_text(json.dumps({**claim, **build()}))
    dtypes = ("bf16", "fp16")
    # node 1 would wait 30 s for the commit, then FleetWaitError, unless the leader stops it
    out = run_nodes(lambda k: _node(node_dirs[k], sink.as_uri(), dtype=dtypes[k], wait_seconds=30)[0], 2)
    assert isinstance(out[0], ConfigError) and "node 1 built" in str(out[0]), out
    assert isinstance(out[1], ConfigError) and "node 0 stopped" in str(out[1]), out
    assert (
        "node 1 built" in str(out[1])
        and not (sink / layout.step_dir_name(STEP) / "stagerd.manifest.json").exists()
    )


def test_an_owner_whose_shard_became_a_link_after_its_part_was_sent_stops_the_leader(tmp_path, dcp_mixed2):
    """Node 1's shard replaced by a link once its raw part is on the exchange, while it waits for node 0's:
    its mirror refuses it (SymlinkError, quarantined there), and the leader, waiting for node 1's files,
    used to wait again for as long as it ran. Now it stops with node 1's error."""
    from stagerd.errors import SymlinkError

    _, node_dirs = _stage(tmp_path, dcp_mixed2[0], 2)
    sink = (tmp_path / "sink").as_uri()
    shard = sorted((node_dirs[1] / "model").glob("*.safetensors"))[0]
    swapped = threading.Event()

    def swap(text: str, n: int) -> None:  # node 1 waits for node 0's part: its own part is sent
        if text and not swapped.is_set():
            shutil.move(shard, tmp_path / shard.name)
            shard.symlink_to(tmp_path / shard.name)
            swapped.set()

    def node(k: int):
        n = _node(node_dirs[k], sink, wait_seconds=30)[0]
        if k == 1:
            n.x.status = swap
        else:
            assert swapped.wait(60)  # node 0 comes once node 1 waits for it
        return n

    # node 0 would wait 30 s for node 1's files, then FleetWaitError, unless node 1 stops it
    out = run_nodes(node, 2)
    assert isinstance(out[1], SymlinkError) and shard.name in str(out[1]), out
    assert isinstance(out[0], SymlinkError) and "node 1 stopped" in str(out[0]), out
    assert not (tmp_path / "sink" / layout.step_dir_name(STEP) / "stagerd.manifest.json").exists()
