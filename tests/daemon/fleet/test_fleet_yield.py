"""A fleet node's build yields the disk to a save being written in its own ROOT, as a single daemon's export
does: the trainer saves on every node at once, and each node's build pauses for its own node's save, at
most its budget; the raw part and the uploads (the network's) never pause, and the step still commits."""

from __future__ import annotations

from stagerd.contract import layout
from stagerd.daemon.fleet.node import FleetNode, FleetOptions
from stagerd.daemon.yielding import SavesInFlight, Yielder
from stagerd.sinks.fetch import RemoteStore
from stagerd.sinks.fsspec import FsspecSink
from tests.daemon.fleet.test_protocol import SHARD, STEP, _stage
from tests.daemon_helpers import Appender
from tests.fleet_helpers import run_nodes


def test_each_nodes_build_pauses_for_its_own_save_then_the_step_commits(tmp_path, dcp_mixed2):
    _, node_dirs = _stage(tmp_path, dcp_mixed2[0], 2)
    url = (tmp_path / "sink").as_uri()
    blobs = [d.parent / layout.step_dir_name(STEP + 1) / layout.OPTIM_DIR / "blob" for d in node_dirs]
    writers = [Appender(b) for b in blobs]
    pauses = [Yielder(SavesInFlight(d.parent), "export", STEP, 1.0, lambda: False) for d in node_dirs]

    def node(k: int) -> FleetNode:
        opts = FleetOptions(max_shard_size=SHARD, wait_seconds=30, poll_seconds=0.05, pause=pauses[k])
        ex, store = FsspecSink.from_url(url), RemoteStore.open(url)
        return FleetNode(node_dirs[k], tmp_path / f"w{k}", [ex], ex, store, str(k), opts)

    try:
        out = run_nodes(node, 2)
    finally:
        for w in writers:
            w.stop()
    assert all(r.built for r in out), out  # type: ignore[union-attr]
    assert [round(p.spent) for p in pauses] == [1, 1], [p.spent for p in pauses]
    assert (tmp_path / "sink" / layout.step_dir_name(STEP) / layout.MANIFEST_NAME).is_file()
