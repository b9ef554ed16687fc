"""Two runs (two fleets, each its own node-local ROOTs and saves) on one exchange reach the same step
number: the second run's node is refused by name, as one daemon claiming another's node is, but told what
it is (another run's save) and what to change (a prefix or an exchange per run), where its hint spoke
only of node ids; nothing of it is written into the first run's step, whose export stands."""

from __future__ import annotations

from stagerd.contract import layout
from stagerd.daemon.fleet.node import FleetResult
from stagerd.errors import FleetNodeConflictError
from tests.daemon.fleet.test_protocol import STEP, _node, _run_all, _stage


def test_a_second_run_on_one_exchange_is_told_it_is_another_run(tmp_path, dcp_mixed2):
    _, run_a = _stage(tmp_path / "a", dcp_mixed2[0], 2)
    _, run_b = _stage(tmp_path / "b", dcp_mixed2[0], 2)
    sink = tmp_path / "sink"
    assert all(isinstance(r, FleetResult) for r in _run_all(run_a, sink.as_uri()))
    manifest = (sink / layout.step_dir_name(STEP) / layout.MANIFEST_NAME).read_bytes()
    node, _ = _node(run_b[0], sink.as_uri(), wait_seconds=0.5)
    try:
        node.run()
        raise AssertionError("run b's node 0 published over run a's step")
    except FleetNodeConflictError as e:
        assert "another run's save of this step" in str(e), e
        assert "its own sink prefix" in e.hint and "--exchange" in e.hint, e.hint
    assert (sink / layout.step_dir_name(STEP) / layout.MANIFEST_NAME).read_bytes() == manifest
    raw = sink / "raw" / layout.step_dir_name(STEP) / "node-00000-of-00002" / layout.MARKER_NAME
    assert raw.read_bytes() == (run_a[0] / layout.MARKER_NAME).read_bytes()  # run a's part, not run b's
