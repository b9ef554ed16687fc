"""Each fsspec sink of a fleet is its own lane, as a single daemon's sinks are: a sink that cannot be
written stops only itself. The healthy sink's step commits with its `latest`; the dead one's failure is the
named, retryable `SinkError` of a single daemon's publish, naming the sink's key; once it heals, its lane
(`FleetNode`'s `lanes`) commits it alone, and only then is the step recorded done on the exchange."""

from __future__ import annotations

from stagerd.contract import layout
from stagerd.daemon.fleet.node import FleetNode, FleetOptions
from stagerd.errors import SinkAuthError, SinkError
from stagerd.sinks.fetch import RemoteStore
from stagerd.sinks.fsspec import FsspecSink
from stagerd.sinks.prune import FLEET_DONE
from tests.daemon.fleet.test_protocol import SHARD, STEP, _stage
from tests.fleet_helpers import run_nodes
from tests.s3server import s3, s3_server  # noqa: F401  (fixtures)


def _run(node_dirs, tmp_path, urls, lanes=None):
    def node(k: int) -> FleetNode:
        sinks = [FsspecSink.from_url(u) for u in urls]
        mine = None if lanes is None else [s for s in sinks if s.url in lanes]
        opts = FleetOptions(max_shard_size=SHARD, wait_seconds=5, poll_seconds=0.05)
        ex, store = FsspecSink.from_url(urls[0]), RemoteStore.open(urls[0])
        return FleetNode(node_dirs[k], tmp_path / f"w{k}", sinks, ex, store, str(k), opts, lanes=mine)

    return run_nodes(node, len(node_dirs))


def test_a_dead_sink_stops_only_its_own_lane_and_commits_alone_once_healed(tmp_path, dcp_mixed2):
    _, node_dirs = _stage(tmp_path, dcp_mixed2[0], 2)
    (tmp_path / "b").symlink_to(tmp_path / "mnt" / "b")  # not mounted: every write fails
    urls = [(tmp_path / s).as_uri() for s in ("a", "b")]
    step = layout.step_dir_name(STEP)
    done = tmp_path / "a" / "fleet" / step / FLEET_DONE

    out = _run(node_dirs, tmp_path, urls)
    # the healthy sink: committed, with its `latest`, whatever the other does
    assert (tmp_path / "a" / step / layout.MANIFEST_NAME).is_file(), out
    assert (tmp_path / "a" / "latest").read_text() == step
    for r in out:  # the dead one: each node's run names it, retryably, as one daemon's publish
        err = getattr(r, "failed", {}).get(urls[1])
        assert isinstance(err, SinkError) and err.retryable and urls[1] in str(err), out
    assert not done.exists()  # its lane still builds from the raw parts: retention must not take them

    (tmp_path / "mnt" / "b").mkdir(parents=True)  # healed: the sink's lane alone publishes it on each node
    healed = _run(node_dirs, tmp_path, urls, lanes={urls[1]})
    assert all(not getattr(r, "failed", True) for r in healed), healed
    a, b = tmp_path / "a" / step, tmp_path / "b" / step
    files = {p.name: p.read_bytes() for p in a.iterdir() if p.name != layout.MANIFEST_NAME}
    assert {p.name: p.read_bytes() for p in b.iterdir() if p.name != layout.MANIFEST_NAME} == files
    assert (b / layout.MANIFEST_NAME).is_file()
    assert (tmp_path / "b" / "latest").read_text() == step
    assert done.is_file()


def test_a_dead_first_sink_that_is_the_exchange_is_named_as_the_exchange(tmp_path, dcp_mixed2):
    """The exchange (by default the first sink) is the one place every node meets: no node may move to
    another the others would not agree on, so its failure stops every sink of the step. It says so: the
    retryable `SinkError` names the exchange and the `--exchange` that keeps a dead sink from stopping
    the others; nothing is published anywhere."""
    _, node_dirs = _stage(tmp_path, dcp_mixed2[0], 2)
    (tmp_path / "a").symlink_to(tmp_path / "mnt" / "a")  # not mounted: every write fails
    urls = [(tmp_path / s).as_uri() for s in ("a", "b")]
    out = _run(node_dirs, tmp_path, urls)
    for r in out:
        assert isinstance(r, SinkError) and r.retryable, out
        assert "the fleet's exchange failed" in str(r) and urls[0] in str(r), r
        assert "--exchange" in r.hint and "\n" not in str(r), r.hint
    assert not (tmp_path / "b" / layout.step_dir_name(STEP) / layout.MANIFEST_NAME).exists()


def test_two_daemons_publish_the_healthy_sink_and_the_dead_ones_lane_retries_until_healed(
    tmp_path, dcp_mixed2
):
    """Through `stagerd watch`: sink b's lane (not the step) fails with its `SinkError` in the journal and
    `stagerd status`, while a holds the step; a restart once b is healed commits b by its lane alone, and
    only then is each node's staged step retired."""
    from stagerd.daemon.journal import Journal
    from tests.cli_helpers import run_cli
    from tests.daemon.fleet.test_daemon import _done, _watch

    _, node_dirs = _stage(tmp_path, dcp_mixed2[0], 2)
    (tmp_path / "b").symlink_to(tmp_path / "mnt" / "b")  # not mounted: every write fails
    a, b = (tmp_path / "a").as_uri(), (tmp_path / "b").as_uri()
    env = {"STAGERD_RETRY_BASE_SECONDS": "0.1"}

    def both() -> list[tuple[int, str]]:
        procs = [_watch(d.parent, a, "--sink", b, "--keep-last", "0", env=env) for d in node_dirs]
        return [_done(p) for p in procs]

    logs = both()
    assert (tmp_path / "a" / layout.step_dir_name(STEP) / layout.MANIFEST_NAME).is_file(), logs
    for d in node_dirs:
        j = Journal.open_readonly(d.parent)
        try:
            lanes = {ln.sink: ln for ln in j.lanes(STEP)}
        finally:
            j.close()
        assert str(lanes[a].state) == "published", logs
        assert lanes[b].error_class == "SinkError" and lanes[b].attempts == 2, logs  # its own tries
        assert d.is_dir()  # b lacks it: kept
        status = run_cli(["status", d.parent])
        assert "SinkError" in status.stdout + status.stderr, status

    (tmp_path / "mnt" / "b").mkdir(parents=True)
    logs = both()
    assert [rc for rc, _ in logs] == [0, 0], logs
    assert (tmp_path / "b" / layout.step_dir_name(STEP) / layout.MANIFEST_NAME).is_file(), logs
    assert not any(d.exists() for d in node_dirs), logs  # published everywhere: then, and only then


def test_a_failure_a_past_try_left_stops_no_new_try_until_written_again(tmp_path):
    """Node 1's record of its failed try of sink b is still on the exchange when node 0's new try begins
    (node 1's new try, which clears it, may begin later): it must not stop node 0's try, which would fail a
    healed sink's lane again with the old error. A failure node 1 writes in its new try does stop it."""
    from stagerd.daemon.fleet.exchange import StepExchange

    url = (tmp_path / "x").as_uri()
    sink_b = FsspecSink.from_url((tmp_path / "b").as_uri())

    def view(me: int) -> StepExchange:
        return StepExchange(
            FsspecSink.from_url(url), RemoteStore.open(url), STEP, me, 2, 5, 0.05, lambda s, n: None
        )

    node1 = view(1)
    node1.record_failure(sink_b, SinkError("NotADirectoryError: Not a directory", path=sink_b.url))
    node0 = view(0)
    node0.past_failures([sink_b])
    assert node0.failure_of(sink_b, [1]) is None  # a past try's
    node1.record_failure(sink_b, None)  # node 1's new try begins...
    assert node0.failure_of(sink_b, [1]) is None
    node1.record_failure(sink_b, SinkError("NotADirectoryError: Not a directory", path=sink_b.url))
    err = node0.failure_of(sink_b, [1])  # ...and fails again, the same way
    assert isinstance(err, SinkError) and "node 1" in str(err), err


def test_only_the_exchanges_own_keys_are_named_its_failure(tmp_path):
    """A sink's upload (under its `step-N/`) stays that sink's error, also where the exchange is that sink
    or holds it (a sink URL under the exchange's); a claim, record or raw part is the exchange's."""
    from stagerd.daemon.fleet.exchange import StepExchange

    url = (tmp_path / "x").as_uri()
    x = StepExchange(FsspecSink.from_url(url), RemoteStore.open(url), STEP, 0, 2, 5, 0.05, lambda s, n: None)
    nested = FsspecSink.from_url(f"{url}/sink")
    step = layout.step_dir_name(STEP)
    for path in (
        f"{url}/{step}",
        f"{url}/sink/{step}/model.safetensors",
        f"{url}2/fleet/{step}/node-00000.json",
    ):
        e = SinkError("NotADirectoryError: Not a directory", path=path)
        assert x.failure(e, [nested]) is e
    for key in (x.claim_key(0), f"raw/{step}/node-00000-of-00002/model/a.safetensors"):
        named = x.failure(SinkAuthError("permission denied", path=f"{url}/{key}"), [nested])
        assert isinstance(named, SinkAuthError) and "the fleet's exchange failed" in str(named), named
        assert "--exchange" in named.hint


def test_a_leaders_restart_after_its_manifest_aborts_what_killed_owners_left_pending(
    tmp_path,
    dcp_mixed2,
    s3,  # noqa: F811
):
    """A killed owner's multipart upload stays pending until the leader's sweep after the manifest. A
    leader killed between its manifest and that sweep (`fleet.manifest`) finds the step committed when it
    restarts: on every sink, or on the first of two (killed between the sinks' commits). Either way its
    restart sweeps each committed step, and no upload outside the step's prefix."""
    _, node_dirs = _stage(tmp_path, dcp_mixed2[0], 2)
    urls = [s3.url("a"), s3.url("b")]
    assert all(not getattr(r, "failed", True) for r in _run(node_dirs, tmp_path, urls))
    step = layout.step_dir_name(STEP)

    def left(*keys: str) -> dict[str, str]:
        return {s3.client.create_multipart_upload(Bucket=s3.bucket, Key=k)["UploadId"]: k for k in keys}

    def pending() -> dict[str, str]:
        ups = s3.client.list_multipart_uploads(Bucket=s3.bucket).get("Uploads", [])
        return {u["UploadId"]: u["Key"] for u in ups}

    beside = left(f"a/{step}0/x", f"a/{step}.bak/x", f"a/{step}", f"a-1/{step}/x", f"b/{step}0/x")
    killed = (f"a/{step}/model-00001-of-00002.safetensors", f"b/{step}/model-00002-of-00002.safetensors")
    left(*killed)
    s3.client.delete_object(Bucket=s3.bucket, Key=f"b/{step}/{layout.MANIFEST_NAME}")  # b not committed yet
    assert not getattr(_run(node_dirs[:1], tmp_path, urls)[0], "failed", True)  # the leader alone suffices
    assert pending() == beside
    left(*killed)
    assert not getattr(_run(node_dirs[:1], tmp_path, urls)[0], "failed", True)  # every sink committed
    assert pending() == beside
