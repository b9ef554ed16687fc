"""A fleet node's build yields the disk to a save being written in its own ROOT, as a single daemon's export
does: the trainer saves on every node at once, and each node's build pauses for its own node's save, at
most its budget; the raw part and the uploads (the network's) never pause, and the step still commits."""

from __future__ import annotations

import pytest

from stagerd.contract import commit_marker, layout
from stagerd.daemon.fleet.node import FleetNode, FleetOptions
from stagerd.daemon.fleet.plan import Mirror, NodePart
from stagerd.daemon.yielding import SavesInFlight, Yielder
from stagerd.sinks.fetch import RemoteStore, node_part, step_prefix
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


def test_a_mirrors_range_fetches_pause_for_the_nodes_save(tmp_path, dcp_mixed2):
    """Another node's bytes, fetched into this node's mirror, are written to this node's disk."""
    _, node_dirs = _stage(tmp_path, dcp_mixed2[0], 2)
    url = (tmp_path / "exchange").as_uri()
    FsspecSink.from_url(url).publish_raw(node_dirs[1], STEP)
    store = RemoteStore.open(url)
    writer = Appender(node_dirs[0].parent / layout.step_dir_name(STEP + 1) / layout.OPTIM_DIR / "blob")
    pause = Yielder(SavesInFlight(node_dirs[0].parent), "export", STEP, 1.0, lambda: False)
    parts = [
        NodePart(k, commit_marker.read_marker(d), f"{step_prefix(STEP, raw=True)}/{node_part(k, 2)}")
        for k, d in enumerate(node_dirs)
    ]

    def read(key: str, a: int, b: int) -> bytes:
        data: bytes = store.fs.cat_file(store.path(key), start=a, end=b)
        return data

    try:
        mirror = Mirror(tmp_path / "mirror", node_dirs[0], parts, 0, read, pause)
        remote = [n for n in mirror.build() if (node_dirs[1] / layout.MODEL_DIR / n).is_file()]
        sizes = {n: (node_dirs[1] / layout.MODEL_DIR / n).stat().st_size for n in remote}
        mirror.fill((str(mirror.model / n), 0, size) for n, size in sizes.items())
    finally:
        writer.stop()
        store.close()
    assert remote and round(pause.spent) == 1, pause.spent
    for n in remote:
        assert (mirror.model / n).read_bytes() == (node_dirs[1] / layout.MODEL_DIR / n).read_bytes()


def test_a_sinks_lane_run_pauses_for_the_nodes_save_within_the_lanes_budget(tmp_path, dcp_mixed2):
    """A sink that failed in the fleet export is published by its own lane's run of the fleet, retried as
    any publish: that run builds on this node's disk, so it yields as the export's build does."""
    from concurrent.futures import ThreadPoolExecutor

    from stagerd.config import Settings
    from stagerd.daemon.core import Daemon
    from stagerd.daemon.journal import Journal
    from stagerd.errors import SinkError

    _, node_dirs = _stage(tmp_path, dcp_mixed2[0], 2)
    (tmp_path / "b").symlink_to(tmp_path / "mnt" / "b")  # not mounted: every write fails
    sinks = [FsspecSink.from_url((tmp_path / name).as_uri()) for name in ("a", "b")]
    a, b = (s.url for s in sinks)
    daemons = []
    for d in node_dirs:
        settings = Settings(
            root=d.parent, sinks=[a, b], yield_seconds=1.0, max_shard_size=SHARD, metrics_port=0
        )
        daemon = Daemon(settings)
        daemon._sinks = {s.url: FsspecSink.from_url(s.url) for s in sinks}  # each its own clients
        daemon._journal, daemon._jpool = Journal.open(d.parent), ThreadPoolExecutor(1)
        daemons.append(daemon)

    def each(fn):
        with ThreadPoolExecutor(len(daemons)) as pool:
            return [f.result() for f in [pool.submit(fn, k, dm) for k, dm in enumerate(daemons)]]

    each(lambda k, dm: dm._run_fleet(STEP, node_dirs[k]))  # `a` committed; `b` left to its lane
    (tmp_path / "mnt" / "b").mkdir(parents=True)
    blobs = [d.parent / layout.step_dir_name(STEP + 1) / layout.OPTIM_DIR / "blob" for d in node_dirs]
    writers = [Appender(blob) for blob in blobs]

    def lane(k: int, dm: Daemon) -> float:
        with pytest.raises(SinkError):  # its first try says why it failed in the export
            dm._fleet_publish(STEP, b, dm._yielder("publish", STEP, b, local=True))
        pause = dm._yielder("publish", STEP, b, local=True)
        dm._fleet_publish(STEP, b, pause)
        return pause.spent

    try:
        spent = each(lane)
    finally:
        for w in writers:
            w.stop()
        for dm in daemons:
            dm._jpool.shutdown()
            dm._journal.close()
    assert [round(s) for s in spent] == [1, 1], spent
    assert (tmp_path / "b" / layout.step_dir_name(STEP) / layout.MANIFEST_NAME).is_file()
