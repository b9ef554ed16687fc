"""What a node reads from the exchange is written by other processes and may be damaged: a file record
that is not the record of its file, another node's extra gone or resized, a node part no node of the step
has. Each is a named error, at once, and nothing of it reaches a sink's manifest."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stagerd.contract import commit_marker, layout
from stagerd.daemon.fleet.node import FleetResult
from stagerd.errors import FleetNodeConflictError, SinkConflictError
from tests.daemon.fleet.test_protocol import STEP, _run_all, _stage
from tests.dcp_fixtures import commit_step

NAME = layout.step_dir_name(STEP)


def _unpublish(sink: Path) -> None:
    """The sink as a leader killed before its commit leaves it: every file and record there, no manifest."""
    (sink / NAME / layout.MANIFEST_NAME).unlink()
    (sink / "latest").unlink()
    (sink / "fleet" / NAME / "done.json").unlink()


def _records(sink: Path) -> list[Path]:
    return sorted((sink / "fleet" / NAME / "done").glob("*/*.json"))


@pytest.mark.parametrize("damage", ["another file's rel", "no sha256", "rel escaping the step"])
def test_a_file_record_that_is_not_its_files_record_is_never_committed(tmp_path, dcp_mixed2, damage):
    """The leader put a record's `rel`, `size` and `sha256` into the manifest as they were: one without a
    sha256 was a raw KeyError out of the leader; one naming another file (or `../`) a manifest listing that
    file twice and its own never, refused only by verification as a retryable SinkError, retried forever."""
    _, dirs = _stage(tmp_path, dcp_mixed2[0], 2)
    sink = tmp_path / "sink"
    assert all(isinstance(r, FleetResult) for r in _run_all(dirs, sink.as_uri()))
    _unpublish(sink)
    first, second = _records(sink)[:2]
    rec, other = json.loads(first.read_text()), json.loads(second.read_text())
    if damage == "another file's rel":
        rec["rel"] = other["rel"]
    elif damage == "no sha256":
        del rec["sha256"]
    else:
        rec["rel"] = f"../{rec['rel']}"
    first.write_text(json.dumps(rec))
    results = _run_all(dirs, sink.as_uri(), wait_seconds=5)
    assert isinstance(results[0], SinkConflictError), results
    assert first.name in str(results[0]) and "no record of" in str(results[0])
    assert results[0].hint and "remove it" in results[0].hint
    assert not (sink / NAME / layout.MANIFEST_NAME).exists()


def test_another_nodes_extra_gone_from_the_exchange_is_never_published_empty(
    tmp_path, dcp_mixed2, monkeypatch
):
    """Node 1 staged `extras/tokenizer.txt`; its object left the exchange after node 1's raw part was
    complete. The leader read it as `store.read(...) or b""` and committed an empty tokenizer.txt."""
    import stagerd.daemon.fleet.lead as lead_mod

    _, dirs = _stage(tmp_path, dcp_mixed2[0], 2)
    m = commit_marker.read_marker(dirs[1])
    (dirs[1] / layout.EXTRAS_DIR).mkdir()
    (dirs[1] / layout.EXTRAS_DIR / "tokenizer.txt").write_text("vocab")
    commit_step(dirs[1], m.world_size, tensors=m.tensors, created=m.created, staging_node=1, staging_nodes=2)
    sink = tmp_path / "sink"
    gone = sink / "raw" / NAME / "node-00001-of-00002" / layout.EXTRAS_DIR / "tokenizer.txt"
    real = lead_mod.extras_of

    def removed(parts):
        gone.unlink()
        return real(parts)

    monkeypatch.setattr(lead_mod, "extras_of", removed)
    results = _run_all(dirs, sink.as_uri(), wait_seconds=5)
    assert isinstance(results[0], SinkConflictError), results
    assert "tokenizer.txt" in str(results[0]) and "missing" in str(results[0])
    assert not (sink / NAME / layout.MANIFEST_NAME).exists()


def test_a_node_part_of_no_node_of_the_step_is_a_named_error_not_a_wait(tmp_path, dcp_mixed2):
    """`raw/step-N/node-00005-of-00002/` (made by hand, or by a damaged marker) is of this node count but
    of no node of it: the nodes waited for a whole set of parts that never comes, "waiting for node "."""
    _, dirs = _stage(tmp_path, dcp_mixed2[0], 2)
    sink = tmp_path / "sink"
    stray = sink / "raw" / NAME / "node-00005-of-00002" / layout.MANIFEST_NAME
    stray.parent.mkdir(parents=True)
    stray.write_text("{}")
    results = _run_all(dirs, sink.as_uri(), wait_seconds=3)
    for r in results:
        assert isinstance(r, FleetNodeConflictError) and not r.retryable, r
        assert "node-00005-of-00002" in str(r)
    assert not (sink / NAME / layout.MANIFEST_NAME).exists()


def test_a_shard_in_a_folder_of_model_is_a_named_error_on_every_node(tmp_path, dcp_mixed2):
    """Node 1's marker lists `model/sub/NAME` (a valid relative path): the mirror opened `model/sub/NAME`
    under a folder it never made, a raw FileNotFoundError out of every node (node 1 linking its own, the
    leader writing the sparse copy)."""
    from stagerd.errors import ShardError

    _, dirs = _stage(tmp_path, dcp_mixed2[0], 2)
    m = commit_marker.read_marker(dirs[1])
    (shard,) = (dirs[1] / layout.MODEL_DIR).glob("*.safetensors")
    (shard.parent / "sub").mkdir()
    shard.rename(shard.parent / "sub" / shard.name)
    commit_step(dirs[1], m.world_size, tensors=m.tensors, created=m.created, staging_node=1, staging_nodes=2)
    sink = tmp_path / "sink"
    results = _run_all(dirs, sink.as_uri(), wait_seconds=5)
    for r in results:
        assert isinstance(r, ShardError), r
        assert f"sub/{shard.name}" in str(r) and "node 1's marker" in str(r)
    assert not (sink / NAME).exists()


def test_an_extra_named_as_the_manifest_never_lands_on_the_sinks_manifest_key(tmp_path, dcp_mixed2):
    """A node staged `extras/stagerd.manifest.json`: one daemon's publish leaves it out (`scan_dir`), the
    leader uploaded it to the sink's `step-N/stagerd.manifest.json`, the step's commit mark, before any
    record was checked. Now it is left out as one daemon leaves it out, and the step is committed."""
    fake = '{"format": "stagerd.manifest/1", "step": 7, "files": []}'
    _, dirs = _stage(tmp_path, dcp_mixed2[0], 2, extras={layout.MANIFEST_NAME: fake})
    sink = tmp_path / "sink"
    results = _run_all(dirs, sink.as_uri(), wait_seconds=5)
    assert all(isinstance(r, FleetResult) for r in results), results
    manifest = json.loads((sink / NAME / layout.MANIFEST_NAME).read_text())
    assert manifest["files"] and layout.MANIFEST_NAME not in {f["path"] for f in manifest["files"]}


def test_a_claim_whose_settings_are_no_object_is_a_config_error(tmp_path, dcp_mixed2):
    """Node 1's claim on the exchange names `"settings": "damaged"` (this ROOT's, of this save): the
    leader's comparison called `.items()` on it, a raw AttributeError out of the wait for agreement."""
    from stagerd.errors import ConfigError, FleetWaitError
    from tests.daemon.fleet.test_protocol import _node

    _, dirs = _stage(tmp_path, dcp_mixed2[0], 2)
    sink = tmp_path / "sink"
    with pytest.raises(FleetWaitError):  # its claim and raw part sent, it waits for node 0
        _node(dirs[1], sink.as_uri(), wait_seconds=0.2)[0].run()
    key = sink / "fleet" / NAME / "node-00001.json"
    key.write_text(json.dumps({**json.loads(key.read_text()), "settings": "damaged"}))
    with pytest.raises(ConfigError, match="node 1's daemon runs with other settings"):
        _node(dirs[0], sink.as_uri(), wait_seconds=0.5)[0].run()
    assert not (sink / NAME).exists()


def test_a_record_larger_than_any_record_is_refused_not_read_whole(tmp_path, dcp_mixed2):
    """Anyone may put an object of any size at a record's key: every node read it whole into memory, every
    poll, and took it for the record it began with. Now at most 1 MiB and a byte is read, and more is no
    record (a padded but valid record here, as a GiB object would be)."""
    from stagerd.daemon.fleet.exchange import MAX_RECORD_BYTES

    _, dirs = _stage(tmp_path, dcp_mixed2[0], 2)
    sink = tmp_path / "sink"
    assert all(isinstance(r, FleetResult) for r in _run_all(dirs, sink.as_uri()))
    _unpublish(sink)
    first = _records(sink)[0]
    first.write_text(json.dumps({**json.loads(first.read_text()), "pad": "x" * MAX_RECORD_BYTES}))
    results = _run_all(dirs, sink.as_uri(), wait_seconds=5)
    assert isinstance(results[0], SinkConflictError), results
    assert first.name in str(results[0]) and f"over {MAX_RECORD_BYTES} bytes" in str(results[0])
    assert not (sink / NAME / layout.MANIFEST_NAME).exists()


@pytest.mark.parametrize("damage", ["gone", "shorter", "longer"])
def test_a_raw_part_whose_shard_is_not_its_markers_is_a_named_error(tmp_path, dcp_mixed2, damage):
    """Node 1's raw part is complete (its manifest there) but its shard object is gone or of another size
    than its marker lists: gone was a retryable SinkError (FileNotFoundError) on every try, shorter a
    ShardError only once a range past its end was read, longer taken as it was."""
    _, dirs = _stage(tmp_path, dcp_mixed2[0], 2)
    sink = tmp_path / "sink"
    from stagerd.errors import FleetWaitError
    from tests.daemon.fleet.test_protocol import _node

    with pytest.raises(FleetWaitError):  # its raw part sent, it waits for node 0
        _node(dirs[1], sink.as_uri(), wait_seconds=0.2)[0].run()
    (shard,) = (sink / "raw" / NAME / "node-00001-of-00002" / layout.MODEL_DIR).glob("*.safetensors")
    data = shard.read_bytes()
    if damage == "gone":
        shard.unlink()
    else:
        shard.write_bytes(data[:-8] if damage == "shorter" else data + b"\0" * 8)
    with pytest.raises(SinkConflictError, match=f"{layout.MODEL_DIR}/{shard.name} (nowhere|at [0-9]+ bytes)"):
        _node(dirs[0], sink.as_uri(), wait_seconds=0.5)[0].run()
    assert not (sink / NAME).exists()


def test_a_sinks_claim_and_manifest_of_any_size_are_read_capped(tmp_path):
    """Anyone may put an object of any size at a step's claim or manifest key on a sink; the fleet's leader
    read both whole into memory when it claimed the step there. Now at most as much as a claim or a
    manifest can be, and the step is still named another publisher's."""
    import tracemalloc

    from stagerd.contract.manifest import MAX_MANIFEST_BYTES
    from stagerd.daemon.fleet.exchange import StepExchange
    from stagerd.errors import SinkConflictError
    from stagerd.sinks.claims import claim_key, fleet_claim
    from stagerd.sinks.fetch import RemoteStore
    from stagerd.sinks.fsspec import FsspecSink
    from stagerd.sinks.objects import MAX_CLAIM_BYTES

    step, big = layout.step_dir_name(7), 24 << 20
    claim, manifest = tmp_path / "sink" / claim_key(step), tmp_path / "sink" / step / layout.MANIFEST_NAME
    for path, size in ((claim, big), (manifest, 2 * MAX_MANIFEST_BYTES)):
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("wb") as f:  # sparse: the test costs no disk
            f.write(b"{")
            f.truncate(size)
    exchange = (tmp_path / "exchange").as_uri()
    x = StepExchange(
        FsspecSink.from_url(exchange), RemoteStore.open(exchange), 7, 0, 1, 1.0, 0.1, lambda *_: None
    )
    sink = FsspecSink.from_url((tmp_path / "sink").as_uri())
    mine = fleet_claim(tmp_path / "root" / step, [sink.url])

    tracemalloc.start()
    try:
        with pytest.raises(SinkConflictError, match="complete step on this sink"):
            x.claim_step(sink, mine)
        with pytest.raises(SinkConflictError, match="complete step on this sink"):
            x.committed_here(sink, mine)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < MAX_MANIFEST_BYTES + 4 * MAX_CLAIM_BYTES + (2 << 20), peak  # before: both whole, 152 MiB
