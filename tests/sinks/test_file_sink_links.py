"""A file:// sink whose step or `claims/` directory is a link out of the sink: publishing there is a
SymlinkError with nothing written through the link or beside it, and the sink's other steps go on."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from stagerd.contract import layout
from stagerd.errors import SymlinkError
from stagerd.sinks.fsspec import FsspecSink
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
    with pytest.raises(SymlinkError, match="outside the sink"):
        if linked.startswith("raw/"):  # as a raw step's and the fleet's writes go
            sink.backend.write(f"{linked}/{layout.MARKER_NAME}", b"{}")
        else:
            sink.publish(export, 2)
    assert _tree(victim) == before and sorted(os.listdir(victim)) == names_before
    assert not (sink_dir / "claims" / layout.step_dir_name(2)).exists() or linked == "claims"
    if linked != "claims":  # the sink's other steps go on
        sink.publish(make_export(tmp_path / "e3", {"a.safetensors": 100}, seed=3), 3)
        assert (sink_dir / layout.step_dir_name(3) / layout.MANIFEST_NAME).is_file()
