"""A Hugging Face Hub-protocol test server (test infrastructure, not a Hub), with its Xet CAS. See README.md.

    with HubServer() as hub:
        api = HfApi(endpoint=hub.endpoint, token=hub.token)

Uploads go through Xet, as huggingface_hub's do wherever hf_xet is installed; `use_xet(monkeypatch, False)`
picks the classic LFS path for one test.
"""

from __future__ import annotations

import os
from typing import Any

from tests.hubserver.app import HubConfig, HubStats
from tests.hubserver.faults import Fault, FaultPlan
from tests.hubserver.server import HubServer


def use_xet(monkeypatch: Any, on: bool) -> None:
    """Upload through Xet (`on`) or LFS (as `HF_HUB_DISABLE_XET=1` does) until `monkeypatch` undoes it.

    huggingface_hub reads `HF_HUB_DISABLE_XET` once, at import time, into `constants`: both the variable (for
    child processes) and the constant are set. It is configuration, not a patched client call.
    """
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", not on)
    if on:
        monkeypatch.delenv("HF_HUB_DISABLE_XET", raising=False)
    else:
        monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")


def disable_xet() -> None:
    """For a whole process (a benchmark's LFS runs): upload through LFS from now on."""
    os.environ["HF_HUB_DISABLE_XET"] = "1"
    from huggingface_hub import constants

    constants.HF_HUB_DISABLE_XET = True


__all__ = ["Fault", "FaultPlan", "HubConfig", "HubServer", "HubStats", "disable_xet", "use_xet"]
