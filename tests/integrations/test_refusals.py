"""What the callback refuses, before anything is trained or saved (one process, a real Trainer)."""

from __future__ import annotations

import pytest

from stagerd.errors import SaveInputError


def test_the_callbacks_own_arguments_are_refused():
    from stagerd.integrations.transformers import StagerdCallback

    with pytest.raises(SaveInputError, match=r"gives \['model'\] itself"):
        StagerdCallback(root="/nonexistent", model=object())
