"""A fleet wait fails only after `fleet_wait_seconds` with nothing new, and what is new includes the awaited
node's own progress: a leader still building, a raw upload or a build longer than the setting. A node that
makes no progress still times the wait out, named and retryable. Nodes are threads, as in
test_protocol.py; their work is slowed by wrapping the real build or upload, never replaced."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from stagerd.contract import layout
from stagerd.daemon.fleet.build import Artefact
from stagerd.daemon.fleet.node import FleetResult
from stagerd.errors import FleetWaitError
from stagerd.sinks import local
from tests.daemon.fleet.test_protocol import STEP, _node, _stage


def _run(step_dir: Path, sink: Path, wait: float, out: dict[int, object], k: int) -> threading.Thread:
    def one() -> None:
        try:
            out[k] = _node(step_dir, sink.as_uri(), wait_seconds=wait)[0].run()
        except Exception as e:
            out[k] = e

    t = threading.Thread(target=one)
    t.start()
    return t


def _slow_builds(monkeypatch, node: str, before: float = 0.0, each: float = 0.0, gate=None) -> None:
    """Node `node`'s builds (its work dir is under `node{K}/`) wait `before` s, or for `gate`, first, and
    `each` s before each progress report of the real build."""
    build = Artefact.build

    def slow(self, name, out, *, threads, progress):
        if f"/{node}/" in str(out):
            if gate is not None:
                gate.wait(20)
            time.sleep(before)
            real = progress

            def progress(done: int, total: int) -> None:
                time.sleep(each)
                real(done, total)

        return build(self, name, out, threads=threads, progress=progress)

    monkeypatch.setattr(Artefact, "build", slow)


def _published(sink: Path) -> bool:
    return (sink / layout.step_dir_name(STEP) / layout.MANIFEST_NAME).is_file()


def test_a_leader_still_building_keeps_a_non_leaders_wait_alive(tmp_path, dcp_mixed2, monkeypatch):
    """The leader owns 3 of the 5 files and builds each in 0.3 s more than it takes; node 1, done with its
    2, waits 0.6 s at most for anything new. Its text used to be "waiting for the leader (node 0)" however
    many of the leader's files were recorded, so a `--once` run failed the step while the leader worked."""
    _, dirs = _stage(tmp_path, dcp_mixed2[0], 2)
    sink, out = tmp_path / "sink", {}
    _slow_builds(monkeypatch, "node0", before=0.3)
    threads = [_run(dirs[1], sink, 0.6, out, 1), _run(dirs[0], sink, 0.6, out, 0)]
    for t in threads:
        t.join(30)
    assert isinstance(out[1], FleetResult) and isinstance(out[0], FleetResult), out
    assert out[0].committed and len(out[0].built) == 3 and _published(sink)


def test_a_stuck_leader_still_times_a_non_leader_out(tmp_path, dcp_mixed2, monkeypatch):
    """The leader hangs before its builds: node 1's wait sees nothing new for its 0.4 s and fails,
    retryable and naming the leader and what it has seen; once the leader goes on, node 1's retry ends."""
    _, dirs = _stage(tmp_path, dcp_mixed2[0], 2)
    sink, out, gate = tmp_path / "sink", {}, threading.Event()
    _slow_builds(monkeypatch, "node0", gate=gate)
    leader = _run(dirs[0], sink, 0.4, out, 0)
    t0 = time.monotonic()
    try:
        with pytest.raises(
            FleetWaitError,
            match=r"waiting for the leader \(node 0: 2 of 5 files recorded, "
            r"0 of 1 sinks committed; node 0 sending its raw part: \d+ bytes\): nothing new",
        ) as e:
            _node(dirs[1], sink.as_uri(), wait_seconds=0.4)[0].run()
    finally:
        gate.set()
    assert e.value.retryable and time.monotonic() - t0 < 5
    leader.join(30)
    assert isinstance(out[0], FleetResult) and out[0].committed, out
    assert isinstance(_node(dirs[1], sink.as_uri(), wait_seconds=0.4)[0].run(), FleetResult)


def _node1_raw(path: object) -> bool:
    """Whether an upload reads a file of node 1's raw part: by its held /proc/self/fd path, so by the
    file that path names."""
    return f"/node1/{layout.step_dir_name(STEP)}/" in os.path.realpath(str(path))


def test_a_raw_upload_longer_than_the_wait_is_progress(tmp_path, dcp_mixed2, monkeypatch):
    """Node 1 sends its raw part in pieces 0.15 s apart, 1.2 s in all; the leader waits 0.6 s at most for
    anything new. It saw a node's part only once its manifest landed, so it used to give up mid-upload;
    now node 1 reports the bytes it has sent (`fleet/step-N/progress/`), and the leader shows them."""
    iter_file = local.iter_file

    def slow(path, *a, **kw) -> Iterator[memoryview]:
        for view in iter_file(path, *a, **kw):
            if not _node1_raw(path):
                yield view
                continue
            for i in range(0, len(view), -(-len(view) // 4)):
                time.sleep(0.15)
                yield view[i : i + -(-len(view) // 4)]

    monkeypatch.setattr(local, "iter_file", slow)
    _, dirs = _stage(tmp_path, dcp_mixed2[0], 2)
    seen = _leader_beside_node1(dirs, tmp_path / "sink")
    assert any("; node 1 sending its raw part: " in s for s in seen), seen


def test_a_build_longer_than_the_wait_is_progress(tmp_path, dcp_mixed2, monkeypatch):
    """Node 1's build of one file takes 1.6 s (0.1 s before each of its 16 progress reports); the leader
    waits 0.6 s at most for anything new. Its text counted records only, so it used to give up mid-build."""
    _, dirs = _stage(tmp_path, dcp_mixed2[0], 2)
    _slow_builds(monkeypatch, "node1", each=0.1)
    seen = _leader_beside_node1(dirs, tmp_path / "sink")
    assert any("; node 1 building model-" in s for s in seen), seen


def _leader_beside_node1(dirs: list[Path], sink: Path) -> list[str]:
    """The leader, waiting 0.6 s at most for anything new, runs to its commit beside node 1 (in a thread,
    with the same setting); the wait texts the leader showed."""
    out: dict[int, object] = {}
    node0, seen = _node(dirs[0], sink.as_uri(), wait_seconds=0.6)
    t = _run(dirs[1], sink, 0.6, out, 1)  # a node reports every quarter of its own setting
    assert node0.run().committed
    t.join(30)
    assert isinstance(out[1], FleetResult), out
    return seen


class _Crash(Exception):
    """Node 1 dying mid-upload: its run ends there, and its daemon starts it again."""


def test_a_node_in_a_crash_loop_still_times_the_wait_out(tmp_path, dcp_mixed2, monkeypatch):
    """Node 1 dies halfway through each file of its raw part (0.5 s in) and is started again at once, for
    as long as the leader waits: it sends the same bytes again on every run, never more. Its reports
    changed with every run, so the leader (waiting 0.6 s at most for anything new) took each for progress
    and waited for as long as the loop lasted; a report counts now only when the node's work advanced."""
    iter_file = local.iter_file

    def dying(path, *a, **kw) -> Iterator[memoryview]:
        for view in iter_file(path, *a, **kw):
            if not _node1_raw(path):
                yield view
                continue
            for i in range(2):  # its first two quarters, each reported (the reporter writes every 0.15 s)
                yield view[i * len(view) // 4 : (i + 1) * len(view) // 4]
                time.sleep(0.25)
            raise _Crash(path)

    monkeypatch.setattr(local, "iter_file", dying)
    _, dirs = _stage(tmp_path, dcp_mixed2[0], 2)
    sink, over, runs = tmp_path / "sink", threading.Event(), [0]

    def crash_loop() -> None:
        deadline = time.monotonic() + 6
        while not over.is_set() and time.monotonic() < deadline:
            runs[0] += 1
            with pytest.raises(_Crash):
                _node(dirs[1], sink.as_uri(), wait_seconds=0.6)[0].run()

    loop = threading.Thread(target=crash_loop)
    loop.start()
    node0, seen = _node(dirs[0], sink.as_uri(), wait_seconds=0.6)
    t0 = time.monotonic()
    try:
        with pytest.raises(FleetWaitError, match=r"waiting for node 1 \(seen: node-00000-of-00002; node 1 "):
            node0.run()
    finally:
        over.set()
        loop.join(30)
    assert time.monotonic() - t0 < 3.5 and runs[0] >= 2, (runs, seen)


def _hub_export(tmp_path: Path, model: Path) -> tuple[list[Path], Path, str]:
    """Only Hub sinks: the fleet's export committed on the exchange (`EXCHANGE/export`), as the Hub lanes
    find it. Returns the node dirs, the exchange and the export's URL."""
    from stagerd.daemon.fleet.exchange_places import EXPORT_PREFIX
    from tests.fleet_helpers import run_fleet

    _, dirs = _stage(tmp_path, model, 2)
    ex = tmp_path / "exchange"
    staging = (ex / EXPORT_PREFIX).as_uri()
    assert all(isinstance(r, FleetResult) for r in run_fleet(dirs, staging, exchange=ex.as_uri(), hub=True))
    return dirs, ex, staging


def _slow_hub_uploads(monkeypatch, work: str) -> None:
    """Each file uploaded from a work dir named `work` sent in 4 pieces 0.25 s apart."""
    iter_file = local.iter_file

    def slow(path, *a, **kw) -> Iterator[memoryview]:
        for view in iter_file(path, *a, **kw):
            if f"/{work}/" not in str(path):
                yield view
                continue
            for i in range(4):
                time.sleep(0.25)
                yield view[i * len(view) // 4 : (i + 1) * len(view) // 4]

    monkeypatch.setattr(local, "iter_file", slow)


def _hub_lane(dirs: list[Path], ex: Path, staging: str, k: int, hub, work: Path, hubs=()) -> object:
    """Node `k`'s Hub lane for `hub` (a file:// sink standing for the Hub), waiting 0.5 s at most."""
    from stagerd.daemon.fleet.hub import publish_to_hub
    from stagerd.sinks.fetch import RemoteStore
    from stagerd.sinks.fsspec import FsspecSink

    exchange, store = FsspecSink.from_url(ex.as_uri()), RemoteStore.open(ex.as_uri())
    try:
        return publish_to_hub(
            STEP,
            dirs[k],
            work,
            hub,
            FsspecSink.from_url(staging),
            exchange,
            staging,
            exchange_store=store,
            wait_seconds=0.5,
            poll_seconds=0.05,
            hubs=[h.url for h in hubs],
        )
    except Exception as e:
        return e
    finally:
        store.close()


def test_a_hub_lane_waits_for_the_leaders_hub_publish_while_it_advances(tmp_path, dcp_mixed2, monkeypatch):
    """Only a Hub sink: the fleet commits the export on the exchange, then node 0's Hub lane downloads it
    and publishes it (here to a file:// sink standing for the Hub, each file sent in 4 pieces 0.25 s apart,
    over 1 s in all) while node 1's Hub lane waits 0.5 s at most for anything new. Node 1 raised "waiting
    for node 0" at once, a retry each time, and a `--once` run quarantined the step after --max-attempts
    however far node 0 had got; it now waits as every fleet wait does: alone, it times out, named; beside
    the leader's publish, whose reports advance, it ends with the leader's Hub record."""
    from stagerd.daemon.fleet.hub import hub_record_key
    from stagerd.sinks.fsspec import FsspecSink

    dirs, ex, staging = _hub_export(tmp_path, dcp_mixed2[0])
    _slow_hub_uploads(monkeypatch, "hub-work0")  # the leader's Hub upload only
    hub = FsspecSink.from_url((tmp_path / "hub").as_uri())

    def lane(k: int) -> object:
        return _hub_lane(dirs, ex, staging, k, hub, tmp_path / f"hub-work{k}")

    t0 = time.monotonic()
    alone = lane(1)
    assert isinstance(alone, FleetWaitError), alone
    assert "waiting for node 0 to publish step 7 to the Hub" in str(alone) and time.monotonic() - t0 < 2
    out: dict[int, object] = {}

    def node1() -> None:
        t0 = time.monotonic()
        out[1] = lane(1)
        out[2] = time.monotonic() - t0

    t = threading.Thread(target=node1)
    t.start()
    lead = lane(0)
    t.join(30)
    assert out[2] > 1.0, out  # twice its setting: kept waiting by the leader's reports
    assert not getattr(lead, "skipped", True) and getattr(out[1], "skipped", False), (lead, out)
    assert (ex / hub_record_key(STEP)).is_file() and hub.is_published(STEP)


def test_a_second_hub_sinks_publish_is_progress_after_the_first_ended(tmp_path, dcp_mixed2, monkeypatch):
    """Hub sinks a and b: node 0 publishes to a over 1 s, then (its lane for b retried, or started late)
    downloads and publishes the same bytes to b over 1 s, while node 1's lane for b waits 0.5 s at most.
    Both of node 0's lanes reported "publishing it to the Hub", so b's bytes counted as the same work done
    again (a report counts only when work advanced): node 1 gave up on b while node 0 was sending it."""
    from stagerd.sinks.fsspec import FsspecSink

    dirs, ex, staging = _hub_export(tmp_path, dcp_mixed2[0])
    hubs = [FsspecSink.from_url((tmp_path / h).as_uri()) for h in ("a", "b")]
    _slow_hub_uploads(monkeypatch, "w-0")
    out: dict[int, object] = {}
    t = threading.Thread(
        target=lambda: out.update({1: _hub_lane(dirs, ex, staging, 1, hubs[1], tmp_path, hubs)})
    )
    t.start()
    lead = [_hub_lane(dirs, ex, staging, 0, h, tmp_path / "w-0", hubs) for h in hubs]
    t.join(30)
    assert not any(getattr(r, "skipped", True) for r in lead) and getattr(out[1], "skipped", False), (
        lead,
        out,
    )
    assert all(h.is_published(STEP) for h in hubs)
