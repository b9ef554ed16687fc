"""Llama, tied and untied: the export is what `save_pretrained` writes, and loads to the same logits."""

from __future__ import annotations

import pytest

from tests.fidelity import harness

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return harness.run("llama", tmp_path_factory.mktemp("llama"))


def test_untied_llama_is_what_save_pretrained_writes(llama):
    harness.check_all(llama)
