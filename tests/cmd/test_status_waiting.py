"""A fleet step the journal holds failed while it waits for another node is shown waiting, in the table's
state column and in `--json`: it is tried again, never quarantined for it; a step failed otherwise is not."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stagerd.cli import main
from stagerd.contract import layout
from stagerd.daemon.journal import Journal

WAIT = "waiting for node 1 (seen: node-00000-of-00002)"


def _root(tmp_path: Path) -> Path:
    root = tmp_path / "root"
    j = Journal.open(root)
    try:
        j.set_meta(sinks=["file:///srv/sink"])
        for step, error in ((7, "FleetWaitError"), (8, "SinkError")):
            j.add_step(step, root / layout.step_dir_name(step), 1000.0 + step)
            j.begin_export(step)
            j.fail_export(step, error, f"{error} of step {step}", next_try=None, quarantine=False)
        j.set_wait(7, WAIT)
    finally:
        j.close()
    return root


def test_a_step_that_waits_for_a_node_shows_waiting_not_failed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    root = _root(tmp_path)
    assert main(["status", str(root), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert {s["step"]: s["state"] for s in doc["steps"]} == {7: "waiting", 8: "failed"}
    assert doc["counts"]["waiting"] == 1 and doc["counts"]["failed"] == 1, doc["counts"]
    monkeypatch.setenv("COLUMNS", "120")
    assert main(["status", str(root)]) == 0
    out = capsys.readouterr().out
    rows = {w[0]: w[1] for ln in out.splitlines() if (w := ln.split())[:1] in (["7"], ["8"])}
    assert rows == {"7": "waiting", "8": "failed"}, out
    assert "1 failed, 1 waiting" in out, out
    assert f"step 7: {WAIT}" in out and "still waiting (not quarantined): FleetWaitError" in out, out
