"""A fleet claims each sink's step before any node writes under it (`fleet/stake.py`). Before, the owners
uploaded their files to every sink's `step-N/` first and the leader claimed the step only at its commit:
where another publisher (another ROOT, a second run on the same prefix) had claimed step N and was still
publishing, the fleet's owners overwrote its files and only then met its claim. The nodes are threads
running `FleetNode` (each its own ROOT, on a file:// exchange apart from the sinks); the stores are real
directories and moto S3."""

from __future__ import annotations

from pathlib import Path

import pytest

from stagerd.contract import layout
from stagerd.daemon.fleet.node import FleetNode, FleetOptions, FleetResult
from stagerd.engine.export import export_step
from stagerd.errors import SinkConflictError, StepClaimedError
from stagerd.sinks.claims import claim_key, publish_claim
from stagerd.sinks.fetch import RemoteStore
from stagerd.sinks.fsspec import FsspecSink
from tests.daemon.fleet.test_protocol import SHARD, STEP, _stage
from tests.fleet_helpers import FAST, run_nodes
from tests.s3server import s3, s3_server  # noqa: F401  (fixtures)
from tests.sinks.test_retention_owner import _Prefix, _root


def _run(node_dirs: list[Path], urls: list[str], exchange: str) -> list[FleetResult | BaseException]:
    def node(k: int) -> FleetNode:
        sinks = [FsspecSink.from_url(u) for u in urls]
        opts = FleetOptions(**{**FAST, "max_shard_size": SHARD})
        ex, store = FsspecSink.from_url(exchange), RemoteStore.open(exchange)
        root = node_dirs[k].parent
        return FleetNode(node_dirs[k], root / ".stagerd" / "fleet", sinks, ex, store, str(root), opts)

    return run_nodes(node, len(node_dirs))


@pytest.mark.parametrize("store", ["file", "s3"])
def test_a_step_another_root_claimed_on_one_sink_gets_nothing_of_the_fleet_and_the_other_sink_commits(
    request, tmp_path, dcp_mixed2, store
):
    """Another ROOT claimed step 7 on sink b and wrote its files there (under the very names the fleet's
    export has), no manifest yet: every one of its objects stays byte for byte, and nothing of the fleet
    lands under b's `step-7/`; each node names b's failure (`StepClaimedError`, retryable, naming the
    other publish); sink a commits the export, both nodes having built and sent their share."""
    shared, node_dirs = _stage(tmp_path, dcp_mixed2[0], 2)
    for d in node_dirs:
        (d.parent / layout.STATE_DIR).mkdir(exist_ok=True)  # a daemon's ROOT: its identity is its own
    export_step(shared, max_shard_size=SHARD)  # the names the fleet's export has
    names = sorted(p.name for p in (shared / layout.EXPORT_DIR).iterdir())
    b = _Prefix(request, tmp_path, store)
    a = (tmp_path / "a").as_uri()
    step = layout.step_dir_name(STEP)

    other = _root(tmp_path / "other") / step / layout.EXPORT_DIR
    backend = FsspecSink.from_url(b.url).backend
    assert backend.create(claim_key(step), publish_claim(other).encode())  # its publish opened step 7...
    for n in names:  # ...and wrote its files, its manifest not yet
        backend.write(f"{step}/{n}", f"another run's {n}".encode())
    before = {k: _get(b, k) for k in b.step_keys(STEP)}
    assert len(before) == len(names) + 1

    out = _run(node_dirs, [a, b.url], (tmp_path / "exchange").as_uri())
    assert all(isinstance(r, FleetResult) for r in out), out
    assert {k: _get(b, k) for k in b.step_keys(STEP)} == before  # every object its own, and no other
    for r in out:
        err = r.failed.get(b.url)  # type: ignore[union-attr]
        assert isinstance(err, StepClaimedError) and err.retryable, out
        assert "claimed by a publish of" in str(err) and str(other) in str(err), err
        assert claim_key(step) in str(err), err
        assert r.built, out  # both owners sent their share: to sink a
    sink_a = tmp_path / "a" / step
    assert (sink_a / layout.MANIFEST_NAME).is_file()
    assert (tmp_path / "a" / "latest").read_text() == step
    assert sorted(p.name for p in sink_a.iterdir() if p.name != layout.MANIFEST_NAME) == names
    assert out[0].committed  # type: ignore[union-attr]


def _get(prefix: _Prefix, key: str) -> bytes:
    remote = RemoteStore.open(prefix.url)
    try:
        data = remote.read(key.removeprefix("shared/"))
    finally:
        remote.close()
    assert data is not None, key
    return data


def test_an_owner_uploads_only_where_the_sink_still_holds_the_claim_the_leader_recorded(tmp_path):
    """The owner's check (`StepExchange.claim_error`): the recorded claim on the sink lets it write; a claim
    replaced since, or gone (by hand, or a prune), is the retryable `StepClaimedError` naming the key,
    whatever else the step holds, and nothing is written."""
    from stagerd.daemon.fleet.exchange import StepExchange

    url = (tmp_path / "x").as_uri()
    sink = FsspecSink.from_url((tmp_path / "b").as_uri())
    x = StepExchange(FsspecSink.from_url(url), RemoteStore.open(url), STEP, 1, 2, 5, 0.05, lambda s, n: None)
    step = layout.step_dir_name(STEP)
    key = claim_key(step)
    ours = publish_claim(_root(tmp_path / "ours") / step).encode()
    assert sink.backend.create(key, ours)
    assert x.claim_error(sink, ours) is None

    theirs = publish_claim(_root(tmp_path / "theirs") / step).encode()
    sink.backend.write(key, theirs)
    err = x.claim_error(sink, ours)
    assert isinstance(err, StepClaimedError) and err.retryable and "theirs" in str(err), err
    (tmp_path / "b" / key).unlink()
    err = x.claim_error(sink, ours)
    assert isinstance(err, StepClaimedError) and "is gone" in str(err) and key in str(err), err

    sink.backend.write(f"{step}/{layout.MANIFEST_NAME}", b"{}")  # a manifest lets nothing in either
    assert isinstance(x.claim_error(sink, ours), StepClaimedError)
    assert sorted(p.name for p in (tmp_path / "b" / step).iterdir()) == [layout.MANIFEST_NAME]


@pytest.mark.parametrize("store", ["file", "s3"])
def test_a_step_another_root_committed_on_one_sink_is_not_written_into(request, tmp_path, dcp_mixed2, store):
    """Another ROOT published step 7 on sink b completely (claim, files, manifest) under the fleet's own
    file names. Before, the fleet's early claim passed any step with a manifest and its owners uploaded
    over that run's files (the commit then found the step published and only moved `latest`). Now every
    object of b stays byte for byte, `latest` included; each node names b's `SinkConflictError` (not
    retried: the step is the other run's); sink a commits."""
    shared, node_dirs = _stage(tmp_path, dcp_mixed2[0], 2)
    for d in node_dirs:
        (d.parent / layout.STATE_DIR).mkdir(exist_ok=True)
    export_step(shared, max_shard_size=SHARD)
    names = sorted(p.name for p in (shared / layout.EXPORT_DIR).iterdir())
    b = _Prefix(request, tmp_path, store)
    a = (tmp_path / "a").as_uri()
    step = layout.step_dir_name(STEP)
    theirs = _root(tmp_path / "other") / step / layout.EXPORT_DIR
    theirs.mkdir(parents=True)
    for n in names:
        (theirs / n).write_bytes(f"another run's {n}".encode())
    other = FsspecSink.from_url(b.url)
    try:
        assert not other.publish(theirs, STEP).skipped
    finally:
        other.close()
    before = {k: _get(b, k) for k in b.keys()}  # noqa: SIM118 (b.keys is a function)

    out = _run(node_dirs, [a, b.url], (tmp_path / "exchange").as_uri())
    assert all(isinstance(r, FleetResult) for r in out), out
    assert {k: _get(b, k) for k in b.keys()} == before  # noqa: SIM118
    for r in out:
        err = r.failed.get(b.url)  # type: ignore[union-attr]
        assert isinstance(err, SinkConflictError) and not err.retryable, out
        assert "complete step" in str(err) and str(theirs) in str(err), err
    assert (tmp_path / "a" / step / layout.MANIFEST_NAME).is_file()
    assert out[0].committed  # type: ignore[union-attr]
