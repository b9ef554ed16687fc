"""An export made with other options than the ones asked now is never published silently (issue 19, item 6).

A run killed after exporting with `--dtype keep`, then restarted with `--dtype bf16`, used to publish the
F32 export with exit 0 and no log line. The options an export was made with are kept beside it now: the
export is rebuilt while no sink holds it, and is an ExportMismatchError once one does.
"""

from __future__ import annotations

import json
import shutil

import pytest
from safetensors import safe_open

from stagerd.contract import layout
from stagerd.engine.export import export_step
from tests.cli_helpers import run_cli
from tests.daemon_helpers import fast_flags, stage_copy


def _dtypes(export: str | object) -> set[str]:
    found = set()
    for f in sorted(__import__("pathlib").Path(str(export)).glob("*.safetensors")):
        with safe_open(f, "np") as st:
            found |= {st.get_slice(k).get_dtype() for k in st.keys()}  # noqa: SIM118
    return found


def test_an_export_of_other_options_is_rebuilt_before_anything_is_published(tmp_path, dcp_mixed2):
    model, _ = dcp_mixed2
    root, sink = tmp_path / "root", tmp_path / "sink"
    step_dir = stage_copy(root, 100, model, world=2)
    export_step(step_dir)  # a run with --dtype keep got this far, then died
    assert "F32" in _dtypes(step_dir / layout.EXPORT_DIR)

    r = run_cli(["watch", root, "--sink", sink.as_uri(), "--once", "--dtype", "bf16", *fast_flags()])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "made with other options" in r.stderr
    published = _dtypes(sink / "step-00000100")
    assert "F32" not in published and "BF16" in published
    options = json.loads((step_dir / layout.EXPORT_OPTIONS_NAME).read_text())
    assert options["dtype"] == "BF16"


@pytest.mark.parametrize("export", ["removed", "kept"])
def test_once_a_sink_holds_the_export_other_options_are_a_named_error(tmp_path, dcp_mixed2, export):
    """A sink added under another --dtype: whether the old export is still in staging or not, the new sink
    never gets it as it is."""
    model, _ = dcp_mixed2
    root, first, second = tmp_path / "root", tmp_path / "first", tmp_path / "second"
    stage_copy(root, 100, model, world=2)
    done = run_cli(["watch", root, "--sink", first.as_uri(), "--once", *fast_flags()])
    assert done.returncode == 0, done.stderr[-3000:]
    if export == "removed":
        shutil.rmtree(root / "step-00000100" / layout.EXPORT_DIR)  # gone before a new sink got it

    args = ["watch", root, "--sink", first.as_uri(), "--sink", second.as_uri(), "--once", "--dtype", "bf16"]
    r = run_cli([*args, *fast_flags()])
    assert r.returncode == 1 and "ExportMismatchError" in r.stderr, r.stderr[-3000:]
    assert "dtype 'keep' -> 'BF16'" in r.stderr and f"{second.as_uri()} pending" in r.stderr
    assert "None: None" not in r.stderr
    assert not (second / "step-00000100").exists()  # the two sinks never hold different weights


def test_a_shard_size_left_to_the_default_keeps_the_size_a_sink_holds(tmp_path, dcp_mixed2):
    """A daemon upgraded to another default size, and given a new sink, publishes there the files the first
    sink holds, even once the export is gone from staging, instead of refusing the step."""
    model, _ = dcp_mixed2
    root, first, second = tmp_path / "root", tmp_path / "first", tmp_path / "second"
    stage_copy(root, 100, model, world=2)
    old = run_cli(
        ["watch", root, "--sink", first.as_uri(), "--once", "--max-shard-size", "2KB", *fast_flags()]
    )
    assert old.returncode == 0, old.stderr[-3000:]
    held = sorted(p.name for p in (first / "step-00000100").iterdir())
    assert len([n for n in held if n.endswith(".safetensors")]) > 1
    shutil.rmtree(root / "step-00000100" / layout.EXPORT_DIR)

    r = run_cli(["watch", root, "--sink", first.as_uri(), "--sink", second.as_uri(), "--once", *fast_flags()])
    assert r.returncode == 0, r.stderr[-3000:]
    assert sorted(p.name for p in (second / "step-00000100").iterdir()) == held
    for name in (n for n in held if n.endswith((".safetensors", ".json")) and "manifest" not in n):
        assert (second / "step-00000100" / name).read_bytes() == (first / "step-00000100" / name).read_bytes()
