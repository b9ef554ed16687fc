"""Qwen3-MoE (tied and untied) and Mixtral: transformers 5 keeps their experts fused in memory, and the
export is the Hub layout `save_pretrained` writes, converted by byte moves from the marker's to-Hub plan."""

from __future__ import annotations

import pytest

from tests.fidelity import harness

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("kind", ["qwen3_moe", "qwen3_moe_tied", "mixtral"])
def test_a_fused_moe_exports_the_hub_layout(kind, tmp_path):
    harness.check_all(harness.run(kind, tmp_path, model=True))
