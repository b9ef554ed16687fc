"""Shard 3 of the installed transformers' registry cases (`cases.py`): each exports, kept and in bf16,
what `save_pretrained` writes."""

from __future__ import annotations

import pytest

from tests.fidelity.registry import cases as registry


@pytest.mark.parametrize("case", registry.params(3), ids=lambda c: c.id)
def test_the_export_is_what_save_pretrained_writes(case, registry_run):
    registry_run.run(case)
