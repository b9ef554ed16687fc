"""A Hugging Face Hub-protocol test server (test infrastructure, not a Hub). See README.md here.

    with HubServer() as hub:
        api = HfApi(endpoint=hub.endpoint, token=hub.token)

`disable_xet()` must run before the client uploads: the tests cannot reach a Xet CAS server.
"""

from __future__ import annotations

import os

from tests.hubserver.app import HubConfig, HubStats
from tests.hubserver.faults import Fault, FaultPlan
from tests.hubserver.server import HubServer


def disable_xet() -> None:
    """Make huggingface_hub use the LFS protocol, as `HF_HUB_DISABLE_XET=1` does.

    huggingface_hub reads `HF_HUB_DISABLE_XET` once, at import time, into `constants`. The variable is
    set here for later imports and child processes; if the library was imported already (by another
    test module), the constant it read is set to the same value, so the switch does not depend on
    which test file pytest collects first. It is configuration, not a patched client call.
    """
    os.environ["HF_HUB_DISABLE_XET"] = "1"
    from huggingface_hub import constants

    constants.HF_HUB_DISABLE_XET = True


__all__ = ["Fault", "FaultPlan", "HubConfig", "HubServer", "HubStats", "disable_xet"]
