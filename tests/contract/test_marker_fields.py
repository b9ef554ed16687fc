"""Every field of a commit marker or a published manifest, given any JSON value, is read as its type or
refused as a MarkerError: nothing of another type reaches the code that uses it."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stagerd.contract import commit_marker, layout
from stagerd.contract.dtypes import parse_export_dtype
from stagerd.contract.manifest import ExportManifest, ManifestFile
from stagerd.contract.safetensors_format import encode_header
from stagerd.errors import MarkerError, StagerdError
from tests.cli_helpers import run_cli

FIELDS = ["step", "world_size", "files", "created", "reference_index", "dtype", "metadata", "tensors"]
FIELDS += ["staging_node", "staging_nodes", "hub_plan", "adapter_plan"]

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats()  # NaN and the infinities too: json.loads reads them
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=8,
)


def _marker() -> dict:
    return commit_marker.CommitMarker(
        step=1, world_size=1, files=(commit_marker.StagedFile("model/a", 4),)
    ).to_json()


@settings(max_examples=400, deadline=None)
@given(field=st.sampled_from(FIELDS), value=json_values)
def test_any_value_of_any_field_is_its_type_or_a_marker_error(field, value):
    d = _marker() | {field: value}
    try:
        m = commit_marker.CommitMarker.from_json(json.loads(json.dumps(d)))
    except MarkerError:
        return
    assert isinstance(m.created, float) and math.isfinite(m.created)
    assert m.dtype is None or isinstance(m.dtype, str)
    assert isinstance(m.metadata, dict) and all(isinstance(k, str) for k in m.metadata)
    try:
        parse_export_dtype(m.dtype)
    except StagerdError:
        pass


@settings(max_examples=200, deadline=None)
@given(field=st.sampled_from(["step", "files", "created", "metadata"]), value=json_values)
def test_any_value_of_any_manifest_field_is_its_type_or_a_marker_error(field, value):
    """A manifest is read from a store other tools write to."""
    d = ExportManifest(step=1, files=(ManifestFile("model.safetensors", 4, "0" * 64),)).to_json()
    try:
        m = ExportManifest.from_json(json.loads(json.dumps(d | {field: value})))
    except MarkerError:
        return
    assert isinstance(m.created, float) and math.isfinite(m.created)
    assert isinstance(m.metadata, dict) and all(isinstance(k, str) for k in m.metadata)


@pytest.mark.parametrize(
    "field, value, words",
    [
        ("dtype", 5, "dtype must be"),  # before: AttributeError: 'int' object has no attribute 'lower'
        ("dtype", ["bf16"], "dtype must be"),
        ("created", "nan", "created must be"),  # before: float("nan"), taken as the save's time
        ("created", True, "created must be"),
        ("metadata", [["a", "b"]], "metadata must be"),  # before: dict() of pairs, keys of any type
        # before: taken, and the daemon's fleet export of the step made a dict of 10^9 claim keys
        ("staging_nodes", 10**9, "at most 65536 nodes"),
    ],
)
def test_consolidate_of_a_marker_field_of_another_type_is_exit_2_and_writes_nothing(
    tmp_path: Path, field, value, words
):
    step = tmp_path / layout.step_dir_name(1)
    (step / "model").mkdir(parents=True)
    info = json.dumps({"w": {"saved_offsets": [0]}})
    head = encode_header({"w": ("F32", (1,), 0, 4)}, {"DCP_SHARDING_INFO": info, "format": "pt"})
    shard = step / "model" / "shard-00001-model-00001-of-00001.safetensors"
    shard.write_bytes(head + bytes(4))
    files = (commit_marker.StagedFile(f"model/{shard.name}", len(head) + 4),)
    m = commit_marker.CommitMarker(step=1, world_size=1, files=files)
    (step / layout.MARKER_NAME).write_text(json.dumps(m.to_json() | {field: value}))
    r = run_cli(["consolidate", step, tmp_path / "out"])
    assert r.returncode == 2 and "MarkerError" in r.stderr and words in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "out").exists()
