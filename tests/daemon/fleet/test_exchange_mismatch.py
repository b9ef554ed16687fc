"""Nodes whose daemons meet on different exchanges (one given `--exchange`, the other not, so meeting on
its first sink) never see each other's parts: each waits for the other. The node given `--exchange` sees
the other's claim on its first sink and its wait says so, naming the setting, where it only said
"waiting for node 1" until `FleetWaitError`; nothing is published."""

from __future__ import annotations

from stagerd.contract import layout
from stagerd.errors import FleetWaitError
from tests.daemon.fleet.test_protocol import STEP, _node, _stage
from tests.fleet_helpers import run_nodes


def test_a_node_meeting_on_another_exchange_is_named_in_the_wait(tmp_path, dcp_mixed2):
    _, node_dirs = _stage(tmp_path, dcp_mixed2[0], 2)
    sink, exchange = (tmp_path / "sink").as_uri(), (tmp_path / "exchange").as_uri()
    seen: list[list[str]] = [[], []]

    def node(k: int):
        n, said = _node(node_dirs[k], sink, exchange if k == 0 else None, wait_seconds=1.5)
        seen[k] = said
        return n

    out = run_nodes(node, 2)
    assert all(isinstance(r, FleetWaitError) for r in out), out
    assert f"node 1 claimed this step on {sink}, not on this node's exchange {exchange}" in str(out[0])
    assert "every node's daemon must pass the same --exchange" in str(out[0]), out[0]
    assert any("--exchange" in s for s in seen[0]), seen[0]  # shown while it waits, not only at its end
    assert not (tmp_path / "sink" / layout.step_dir_name(STEP) / layout.MANIFEST_NAME).exists()
