"""JSON nested past the decoder's recursion limit, in any file stagerd reads that others may write, is bad
JSON like any other: the reader's own answer to a bad file, never a RecursionError out of it."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from stagerd.contract import commit_marker, layout, lineage, root_id
from stagerd.contract.json_fields import loads
from stagerd.contract.key_mapping import KeyMapping
from stagerd.engine.export import mapped_plan
from stagerd.errors import HubPlanError

NESTED = "[" * 50_000  # 50 KB, within every limit on these files: the C decoder recurses once a level


def test_loads_says_nested_too_deep_as_a_value_error():
    with pytest.raises(ValueError, match="nested too deep"):
        loads(NESTED)
    assert loads(b'{"a": [1]}') == {"a": [1]}


def test_a_nested_lineage_is_unreadable_and_counts_no_ancestors(tmp_path: Path, caplog):
    """Before: a RecursionError out of `ancestors`, which retention and restore read."""
    lineage.lineage_path(tmp_path).parent.mkdir(parents=True)
    lineage.lineage_path(tmp_path).write_text(NESTED)
    with caplog.at_level(logging.WARNING):
        assert lineage.ancestors(tmp_path) == ()
    assert "not JSON" in caplog.text


def test_a_nested_root_id_file_is_replaced_by_a_new_identity(tmp_path: Path):
    """Before: a RecursionError out of `root_id`, which the daemon reads at start."""
    path = tmp_path / layout.STATE_DIR / root_id.ROOT_ID_NAME
    path.parent.mkdir(parents=True)
    path.write_text(NESTED)
    new = root_id.root_id(tmp_path)
    assert root_id.ROOT_ID.fullmatch(new) and root_id.root_id(tmp_path) == new


def test_a_nested_key_mapping_is_a_hub_plan_error(tmp_path: Path):
    """Before: `watch --mapping` of such a file raised RecursionError at each step's export."""
    mapping = tmp_path / "mapping.json"
    mapping.write_text(NESTED)
    marker = commit_marker.CommitMarker(1, 1, (), tensors={"w": commit_marker.TensorInfo("F32", (2,))})
    with pytest.raises(HubPlanError, match="not JSON"):
        mapped_plan(marker, mapping, tmp_path)
    with pytest.raises(HubPlanError, match="nested too deep"):
        KeyMapping.load(mapping)
