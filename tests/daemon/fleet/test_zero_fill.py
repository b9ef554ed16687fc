"""A to-Hub plan's zero fills on a fleet: every node writes the same scratch shard header (its zero fills
are holes, nothing to fetch), so the export the nodes build together is the single daemon's, byte for
byte, padding included."""

from __future__ import annotations

import pytest

from stagerd.contract import layout
from stagerd.daemon.fleet.node import FleetResult
from stagerd.engine.export import export_step
from tests.daemon.fleet.test_protocol import SHARD, _published, _run_all, _stage, _with_hub_plan
from tests.engine.test_zero_fill import PADS, padded_plan


@pytest.mark.parametrize("dtype", [None, "bf16"])
def test_zero_fills_are_carried_out_as_by_one_daemon(tmp_path, dcp_mixed2, dtype):
    shared, node_dirs = _stage(tmp_path, dcp_mixed2[0], 2, dtype=dtype)
    _with_hub_plan([shared, *node_dirs], padded_plan(dcp_mixed2[1]))
    want = export_step(shared, max_shard_size=SHARD).export_dir
    sink = tmp_path / "sink"
    results = _run_all(node_dirs, sink.as_uri(), exchange=(tmp_path / "exchange").as_uri())
    assert all(isinstance(r, FleetResult) for r in results), results
    got = _published(sink)
    assert got == {p.name: p.read_bytes() for p in want.iterdir()}
    index = got[layout.INDEX_NAME].decode()
    assert all(padded in index for padded, _, _ in PADS.values()) and "#zeros" not in index
