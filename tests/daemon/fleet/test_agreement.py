"""The nodes of a fleet step must agree before anything is committed: one save (every node's marker has
rank 0's `created` and the same global fields), one node count, one plan (the same export settings on
every daemon). A part or a record that disagrees is a named error and no manifest is written; a leader
restarted after its commit still records the step done, so remote retention is never blocked."""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import pytest

from stagerd.contract import commit_marker, layout
from stagerd.daemon.fleet.node import FleetResult
from stagerd.daemon.fleet.version import build
from stagerd.errors import (
    ConfigError,
    FleetNodeConflictError,
    FleetWaitError,
    StagerdError,
    StepConflictError,
)
from tests.daemon.fleet.test_protocol import STEP, _node, _run_all, _stage
from tests.fleet_helpers import run_nodes

NAME = layout.step_dir_name(STEP)


def _manifest(sink: Path) -> Path:
    return sink / NAME / layout.MANIFEST_NAME


def test_a_leader_restarted_after_its_commit_still_records_the_step_done(tmp_path, dcp_mixed2):
    """The state a leader killed at `fleet.manifest` leaves: manifest committed, no `latest`, no
    `done.json`. The restart used to move `latest` only, so `done.json` never came and remote retention
    kept the step's raw parts and records forever."""
    _, node_dirs = _stage(tmp_path, dcp_mixed2[0], 2)
    sink = tmp_path / "sink"
    assert all(isinstance(r, FleetResult) for r in _run_all(node_dirs, sink.as_uri()))
    done = sink / "fleet" / NAME / "done.json"
    done.unlink()
    (sink / "latest").unlink()
    node, _ = _node(node_dirs[0], sink.as_uri())
    assert not node.run().built
    assert (sink / "latest").read_text() == NAME and done.is_file()


def test_a_node_part_of_another_save_is_never_built_into_the_export(tmp_path, dcp_mixed2):
    """Node 1 staged save A of step 7 and sent its raw part, then the run was restarted from an earlier
    checkpoint and node 0 holds save B of step 7. Node 0 owns the only output file: it used to build it
    from its own B shards and node 1's A shards and commit the manifest, one export of two saves."""
    _, a_dirs = _stage(tmp_path / "a", dcp_mixed2[0], 2)
    sink = tmp_path / "sink"
    node1, _ = _node(a_dirs[1], sink.as_uri(), max_shard_size=1 << 30, wait_seconds=0.2)
    with pytest.raises(FleetWaitError):
        node1.run()
    _, b_dirs = _stage(tmp_path / "b", dcp_mixed2[0], 2, dtype="bf16")
    node0, _ = _node(b_dirs[0], sink.as_uri(), max_shard_size=1 << 30, wait_seconds=5)
    with pytest.raises(StepConflictError, match=r"node-00001-of-00002 .* another save"):
        node0.run()
    assert not _manifest(sink).exists() and not (sink / NAME).exists()


def test_node_parts_of_another_node_count_are_a_named_error_not_a_wait(tmp_path, dcp_mixed2):
    """A 3-node save's node 2 sent its part where a 2-node save of the same step meets: the 2-node fleet
    can never see one whole set of parts. It used to wait, retried forever, "waiting for node  (seen:
    ...)"; now every node says which part disagrees, at once."""
    _, three = _stage(tmp_path / "three", dcp_mixed2[0], 3)
    sink = tmp_path / "sink"
    stray, _ = _node(three[2], sink.as_uri(), wait_seconds=0.2)
    with pytest.raises(FleetWaitError):
        stray.run()
    _, two = _stage(tmp_path / "two", dcp_mixed2[0], 2)
    results = _run_all(two, sink.as_uri(), wait_seconds=20)
    for r in results:
        assert isinstance(r, FleetNodeConflictError) and not r.retryable, r
        assert "node-00002-of-00003" in str(r) and "2 nodes" in str(r)
    assert not _manifest(sink).exists()


def test_a_file_built_from_another_plan_is_never_committed(tmp_path, dcp_mixed2):
    """Node 1's daemon runs with --dtype fp16, node 0's with bf16, and the claims name no settings (any
    plan difference the settings do not name; a claim by a stagerd from before settings is now refused by
    its protocol, `test_versions.py`): same file names, same sizes. The leader used to commit node 1's
    fp16 files under its bf16 index. Now each record names the sha256 of the file's header in its owner's
    plan and the leader refuses another by name; with the records deleted (the hint), the step commits the
    bytes of a fleet that always agreed."""
    _, node_dirs = _stage(tmp_path, dcp_mixed2[0], 2)
    sink, good = tmp_path / "sink", tmp_path / "good"
    ok = _run_all(node_dirs, good.as_uri(), dtype="bf16")
    assert all(isinstance(r, FleetResult) for r in ok), ok
    shutil.rmtree(node_dirs[0].parent / ".stagerd", ignore_errors=True)
    (sink / "fleet" / NAME).mkdir(parents=True)
    for k, d in enumerate(node_dirs):  # claims of this build with no settings to compare
        claim = {
            "root": str(d.parent),
            "node": k,
            "nodes": 2,
            "save": commit_marker.marker_identity(d),
            **build(),
        }
        (sink / "fleet" / NAME / f"node-{k:05d}.json").write_text(json.dumps(claim))
    dtypes = ("bf16", "fp16")
    out = run_nodes(lambda k: _node(node_dirs[k], sink.as_uri(), dtype=dtypes[k], wait_seconds=1)[0], 2)
    assert isinstance(out[0], ConfigError) and "node 1 built" in str(out[0]), out
    assert not _manifest(sink).exists()
    shutil.rmtree(sink / "fleet" / NAME / "done")  # as the hint says, once node 1's settings are fixed
    results = _run_all(node_dirs, sink.as_uri(), dtype="bf16")
    assert all(isinstance(r, FleetResult) for r in results), results
    assert results[1].built  # type: ignore[union-attr]

    def tree(root: Path) -> dict[str, bytes]:
        d = root / NAME
        return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.name != layout.MANIFEST_NAME}

    assert tree(sink) == tree(good)
    assert (
        json.loads(_manifest(sink).read_text())["files"] == json.loads(_manifest(good).read_text())["files"]
    )


def test_a_hub_leader_restarted_after_the_hub_record_still_records_the_step_done(tmp_path, dcp_mixed2):
    """Node 0's Hub lane killed between `hub.json` and `done.json`: the restart found the Hub record and
    returned, so `done.json` never came and remote retention kept the step's raw parts forever."""
    from stagerd.daemon.fleet.hub import hub_record_key, publish_to_hub
    from stagerd.sinks.fetch import RemoteStore
    from stagerd.sinks.fsspec import FsspecSink

    _, node_dirs = _stage(tmp_path, dcp_mixed2[0], 2)
    ex = tmp_path / "exchange"
    exchange, staging = (FsspecSink.from_url(u) for u in (ex.as_uri(), (ex / "export").as_uri()))
    exchange.backend.create(hub_record_key(STEP), b'{"location": "hf://acme/fleet"}')
    done = ex / "fleet" / NAME / "done.json"
    for k in (1, 0):  # a Sink that is never called: the Hub already holds the step
        r = publish_to_hub(
            STEP,
            node_dirs[k],
            tmp_path / "w",
            staging,
            staging,
            exchange,
            staging.url,
            exchange_store=RemoteStore.open(ex.as_uri()),
            wait_seconds=1,
        )
        assert r.skipped and done.is_file() == (k == 0)


def test_two_hub_sinks_each_have_their_own_record_and_done_waits_for_both(tmp_path, dcp_mixed2):
    """With Hub sinks a and b, a's record says nothing of b: node 1's lane for b still waits (it took the one
    `hub.json` for b's too and retired its step), and `done.json`, after which retention may take node 1's
    claim (which its lanes take for done), comes only once b's record is there as well."""
    from stagerd.daemon.fleet.hub import hub_record_key, publish_to_hub
    from stagerd.sinks.fetch import RemoteStore
    from stagerd.sinks.fsspec import FsspecSink

    _, node_dirs = _stage(tmp_path, dcp_mixed2[0], 2)
    ex = tmp_path / "exchange"
    exchange, staging = (FsspecSink.from_url(u) for u in (ex.as_uri(), (ex / "export").as_uri()))
    hubs = [FsspecSink.from_url((tmp_path / h).as_uri()) for h in ("a", "b")]  # never called: recorded
    exchange.backend.create(f"fleet/{NAME}/node-00001.json", b"{}")  # node 1's claim, as its export made
    done = ex / "fleet" / NAME / "done.json"

    def lane(k: int, hub: FsspecSink, of: list[FsspecSink] = hubs) -> object:
        try:
            return publish_to_hub(
                STEP,
                node_dirs[k],
                tmp_path / "w",
                hub,
                staging,
                exchange,
                staging.url,
                exchange_store=RemoteStore.open(ex.as_uri()),
                wait_seconds=0.3,
                poll_seconds=0.05,
                hubs=[h.url for h in of],
            )
        except FleetWaitError as e:
            return e

    exchange.backend.create(hub_record_key(STEP, hubs[0].url), b'{"location": "a"}')
    assert getattr(lane(1, hubs[0]), "skipped", False) and getattr(lane(0, hubs[0]), "skipped", False)
    assert not done.exists() and not (ex / hub_record_key(STEP)).exists()
    assert "to the Hub sink " + hubs[1].url in str(lane(1, hubs[1]))
    exchange.backend.create(hub_record_key(STEP, hubs[1].url), b'{"location": "b"}')
    assert getattr(lane(0, hubs[1]), "skipped", False) and done.is_file()
    assert getattr(lane(1, hubs[1]), "skipped", False)
    # one Hub sink: the record an older stagerd knows stands for it, unless it names another sink
    exchange.backend.create(hub_record_key(STEP), json.dumps({"location": "x", "sink": hubs[0].url}).encode())
    c = FsspecSink.from_url((tmp_path / "c").as_uri())
    assert isinstance(lane(1, c, [c]), FleetWaitError)
    exchange.backend.write(hub_record_key(STEP), b'{"location": "x"}')
    assert getattr(lane(1, c, [c]), "skipped", False)


def test_each_wait_gets_the_whole_fleet_wait_seconds(tmp_path, dcp_mixed2):
    """The leader waits 1 s of its 1.5 s for node 1's raw part, builds its files, then waits for node 1's:
    a new wait, with the whole setting, as documented. It used to share one deadline with everything
    before it (its raw upload and its builds too, minutes on a large step), so it gave up 0.5 s into this
    wait, before node 1 even started, and a `--once` run failed the step."""
    import time

    from stagerd.sinks.fsspec import FsspecSink

    _, node_dirs = _stage(tmp_path, dcp_mixed2[0], 2)
    sink = tmp_path / "sink"
    out: list[object] = []
    leader = threading.Thread(target=lambda: out.append(_run_one(node_dirs[0], sink, 1.5)))
    t0 = time.monotonic()
    leader.start()
    time.sleep(1.0)
    FsspecSink.from_url(sink.as_uri()).publish_raw(node_dirs[1], STEP)  # node 1's part, no node 1 yet
    time.sleep(max(0.0, 1.6 - (time.monotonic() - t0)))
    late = _run_one(node_dirs[1], sink, 5)
    leader.join(30)
    assert isinstance(late, FleetResult) and isinstance(out[0], FleetResult), (late, out)
    assert out[0].committed and _manifest(sink).is_file()


def test_a_wait_ends_only_after_the_setting_passes_with_nothing_new(tmp_path):
    """Five records arrive 0.3 s apart under a 0.5 s wait: 1.5 s in all, yet never 0.5 s without one. The
    wait used to give up at 0.5 s however much had arrived (a leader awaiting 8 owners' files, one a
    minute, failed the step at `--fleet-wait-seconds`); a wait that sees nothing new still ends then."""
    import time

    from stagerd.daemon.fleet.exchange import StepExchange
    from stagerd.sinks.fetch import RemoteStore
    from stagerd.sinks.fsspec import FsspecSink

    url, seen = tmp_path.as_uri(), []
    status = lambda text, n: seen.append(text)  # noqa: E731
    x = StepExchange(FsspecSink.from_url(url), RemoteStore.open(url), STEP, 0, 2, 0.5, 0.05, status)
    t0 = time.monotonic()

    def got() -> int:
        return min(5, int((time.monotonic() - t0) / 0.3))

    x.wait(lambda: got() == 5, lambda: f"waiting for the files of node 1 ({got()} of 5 recorded)")
    assert time.monotonic() - t0 >= 1.5 and seen[-1] == "" and "(4 of 5" in seen[-2]
    t1 = time.monotonic()
    with pytest.raises(FleetWaitError, match=r"waiting for node 1: nothing new for 0.5 s"):
        x.wait(lambda: False, lambda: "waiting for node 1")
    assert 0.5 <= time.monotonic() - t1 < 1.0


def _run_one(step_dir: Path, sink: Path, wait: float) -> FleetResult | Exception:
    try:
        return _node(step_dir, sink.as_uri(), wait_seconds=wait)[0].run()
    except Exception as e:
        return e


@pytest.mark.parametrize("differs", ["sinks", "max_shard_size", "dtype", "hubs"])
def test_daemons_with_other_sinks_or_settings_are_a_named_error_before_any_build(
    tmp_path, dcp_mixed2, differs
):
    """Node 1's daemon has only the first of node 0's two sinks, or another --max-shard-size, or a Hub sink
    node 0 has not (its lane for it waited for ever for node 0's publish to it). Before, the
    leader waited forever for files nobody would build (records on the second sink; names of another
    plan) while node 1 uploaded files of its own plan, and, with one sink, saw that sink committed and
    called the step published: its retention could delete the staged step the second sink still needed.
    Now both nodes name the difference from the claims, before anything is built, once it has lasted
    fleet_wait_seconds (a node restarted with fixed settings rewrites its claim: the other may read the
    old one first, and must not fail the step on it)."""
    from stagerd.daemon.fleet.node import FleetNode, FleetOptions
    from stagerd.sinks.fetch import RemoteStore
    from stagerd.sinks.fsspec import FsspecSink

    _, node_dirs = _stage(tmp_path, dcp_mixed2[0], 2)
    urls = [(tmp_path / s).as_uri() for s in ("a", "b")]

    def node(k: int, fixed: bool = False) -> FleetNode:
        k_ = 0 if fixed else k  # fixed: node 1 restarted with node 0's settings
        sinks = [FsspecSink.from_url(u) for u in (urls if k_ == 0 or differs != "sinks" else urls[:1])]
        shard = 1500 if k_ == 0 or differs != "max_shard_size" else 4000
        dtype = "fp16" if k_ == 1 and differs == "dtype" else "bf16"
        # Hub sinks: node 1's lane for b would wait for ever for a leader that publishes to a alone
        hubs = ("hf://acme/a", "hf://acme/b")[: 1 if k_ == 0 and differs == "hubs" else 2]
        opts = FleetOptions(
            dtype=dtype,
            max_shard_size=shard,
            wait_seconds=5 if fixed else 0.5,
            poll_seconds=0.05,
            hub=True,
            hubs=hubs,
        )
        return FleetNode(
            node_dirs[k],
            node_dirs[k].parent / ".stagerd" / "fleet",
            sinks,
            FsspecSink.from_url(urls[0]),
            RemoteStore.open(urls[0]),
            str(node_dirs[k].parent),
            opts,
        )

    out = run_nodes(node, 2)
    for k, r in enumerate(out):
        assert isinstance(r, ConfigError) and f"node {1 - k}" in str(r) and differs in str(r), out
    assert not list((tmp_path / "a").glob(f"{NAME}/*.safetensors"))  # nothing built
    out = run_nodes(lambda k: node(k, fixed=True), 2)  # node 1's claim is rewritten
    assert all(isinstance(r, FleetResult) for r in out), out
    assert all((tmp_path / s / NAME / layout.MANIFEST_NAME).is_file() for s in ("a", "b"))


def test_a_claim_by_an_older_stagerd_naming_no_hub_sinks_still_agrees():
    """An older stagerd's claim names no `hubs`: not compared (a fleet mid-upgrade goes on); one that
    names others is the ConfigError."""
    from stagerd.daemon.fleet.records import settings_errors, settings_of

    mine = settings_of([], "bf16", None, 1500, None, True, ["hf://acme/a"])["settings"]
    older = {n: v for n, v in mine.items() if n != "hubs"}
    assert settings_errors(STEP, 0, {1: {"settings": older}}, mine, "x") == []
    other = settings_of([], "bf16", None, 1500, None, True, ["hf://acme/b"])
    ((k, err),) = settings_errors(STEP, 0, {1: other}, mine, "x")
    assert k == 1 and "hubs: " in str(err)


def test_an_unreadable_mapping_is_still_a_hub_plan_error(tmp_path, dcp_mixed2):
    """The claim names the --mapping file's sha256: a file that cannot be read is the named error the
    plan gives it (guard), never an OSError traceback."""
    from stagerd.errors import HubPlanError

    _, node_dirs = _stage(tmp_path, dcp_mixed2[0], 2)
    node, _ = _node(node_dirs[0], (tmp_path / "sink").as_uri(), mapping=tmp_path / "missing.json")
    with pytest.raises(HubPlanError, match="cannot read the key mapping"):
        node.run()


def test_a_malformed_config_extra_is_refused_as_one_daemon_refuses_it(tmp_path, dcp_mixed2):
    """`generation_config.json` staged as `{not json`: one daemon's export is an `ExtrasError` before
    anything is written; the fleet used to publish it as is. Node 0, which holds the extras, now refuses
    the step before claiming it or sending its raw part, and records why, so node 1 stops too."""
    from stagerd.errors import ExtrasError

    _, node_dirs = _stage(tmp_path, dcp_mixed2[0], 2, extras={"generation_config.json": "{not json"})
    sink = tmp_path / "sink"
    results = _run_all(node_dirs, sink.as_uri(), wait_seconds=0.5)
    assert isinstance(results[0], ExtrasError) and "generation_config.json" in str(results[0]), results
    # node 1 stops too (its wait used to end as FleetWaitError, again on every retry)
    assert isinstance(results[1], ExtrasError) and "node 0 stopped" in str(results[1]), results
    assert not (sink / "fleet" / NAME / "node-00000.json").exists() and not (sink / NAME).exists()


@pytest.mark.parametrize("what", ["claim", "record"])
def test_an_unreadable_claim_or_record_on_the_exchange_is_a_named_error(tmp_path, dcp_mixed2, what):
    """Node 1's claim, or the record of a file it builds, is not JSON on the exchange (written by another
    tool, or damaged): each daemon that read it failed with a bare `JSONDecodeError` ("Expecting property
    name enclosed in double quotes"), no path nor hint, retried for ever. Now a named error naming the key,
    and nothing is committed."""
    from stagerd.sinks.fsspec import FsspecSink

    _, node_dirs = _stage(tmp_path, dcp_mixed2[0], 2)
    sink = tmp_path / "sink"
    url = sink.as_uri()
    from stagerd.daemon.fleet.records import sink_id

    key = f"fleet/{NAME}/node-00001.json"
    if what == "record":
        key = f"fleet/{NAME}/done/{sink_id(url)}/model-00001-of-00005.safetensors.json"
    FsspecSink.from_url(url).backend.write(key, b"{not json")
    out = _run_all(node_dirs, url, wait_seconds=1)
    assert all(isinstance(r, StagerdError) for r in out), out  # each named; node 0 may only wait
    assert any(key in str(r) and "not JSON" in str(r) and not r.retryable for r in out), out
    assert not (sink / NAME / layout.MANIFEST_NAME).exists()
