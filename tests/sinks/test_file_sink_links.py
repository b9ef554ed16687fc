"""A file:// sink whose step, `raw/` or `claims/` directory is a link out of the sink: publishing or
pruning there is a SymlinkError with nothing written or deleted through the link, and the sink's other
steps go on."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest

from stagerd.contract import layout
from stagerd.errors import SymlinkError
from stagerd.sinks.fsspec import FsspecSink
from tests.cli_helpers import run_cli
from tests.sinks.test_sink_fsspec import make_export


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


@pytest.mark.parametrize("linked", [layout.step_dir_name(2), "claims", f"raw/{layout.step_dir_name(2)}"])
def test_a_step_linked_out_of_the_sink_is_refused_and_nothing_outside_changes(tmp_path: Path, linked: str):
    """Before: the publish of step 2 replaced the victim's `a.safetensors` (same name and size) and wrote
    its manifest there, reporting success."""
    sink_dir = tmp_path / "sink"
    sink = FsspecSink.from_url(f"file://{sink_dir}")
    sink.publish(make_export(tmp_path / "e1", {"a.safetensors": 100}, seed=1), 1)
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "a.safetensors").write_bytes(b"precious" * 12 + b"abcd")
    (sink_dir / linked).parent.mkdir(parents=True, exist_ok=True)
    if (sink_dir / linked).exists():
        os.rename(sink_dir / linked, tmp_path / "moved")
        os.rename(tmp_path / "moved", victim / "moved")
    os.symlink(victim, sink_dir / linked)
    before, names_before = _tree(victim), sorted(os.listdir(victim))
    export = make_export(tmp_path / "e2", {"a.safetensors": 100, "b/c.json": 10}, seed=2)
    with pytest.raises(SymlinkError, match="only inside the sink"):
        if linked.startswith("raw/"):  # as a raw step's and the fleet's writes go
            sink.backend.write(f"{linked}/{layout.MARKER_NAME}", b"{}")
        else:
            sink.publish(export, 2)
    assert _tree(victim) == before and sorted(os.listdir(victim)) == names_before
    assert not (sink_dir / "claims" / layout.step_dir_name(2)).exists() or linked == "claims"
    if linked != "claims":  # the sink's other steps go on
        sink.publish(make_export(tmp_path / "e3", {"a.safetensors": 100}, seed=3), 3)
        assert (sink_dir / layout.step_dir_name(3) / layout.MANIFEST_NAME).is_file()


def test_a_prune_never_deletes_through_a_tree_linked_out_of_the_sink(tmp_path: Path):
    """Sink A's `raw/` is a link to sink B: before, `stagerd prune A --keep-last 1` took B's steps for A's
    raw steps and deleted all but B's newest."""
    a, b = tmp_path / "a", tmp_path / "b"
    for sink_dir in (a, b):
        sink = FsspecSink.from_url(f"file://{sink_dir}")
        for step in (1, 2, 3):
            sink.publish(make_export(tmp_path / f"e-{sink_dir.name}{step}", {"a.safetensors": 100}), step)
    os.symlink(b, a / "raw")
    before = _tree(b)
    r = run_cli(["prune", f"file://{a}", "--keep-last", "1"])
    assert r.returncode == 2 and "SymlinkError" in r.stderr and "raw" in r.stderr, r.stderr
    assert _tree(b) == before
    # a step linked out of the sink whose claim is a dead prune's (what it left half done): left alone
    os.unlink(a / "raw")
    victim = tmp_path / "victim"
    os.rename(a / layout.step_dir_name(1), victim)
    os.symlink(victim, a / layout.step_dir_name(1))
    dead = {"kind": "prune", "owner": "h:1:x", "host": socket.gethostname(), "pid": 2**22 + 1}
    (a / "claims" / layout.step_dir_name(1)).write_text(json.dumps(dead))
    kept = _tree(victim)
    r = run_cli(["prune", f"file://{a}", "--keep-last", "1"])
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert _tree(victim) == kept
    assert sorted(p.name for p in a.iterdir() if p.name.startswith("step-")) == [
        layout.step_dir_name(1),
        layout.step_dir_name(3),
    ]
