"""The Hub-protocol test server each Hub test gets as `hub`, driven by the real huggingface_hub client.

By default the sink uploads through Xet (the production path) to a server with `hub_helpers.CONFIG` (small
multipart parts, short pages). A module changes either by defining its own `xet` or `hub_config` fixture.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.hubserver import HubConfig, HubServer, use_xet
from tests.sinks.hub.hub_helpers import CONFIG


@pytest.fixture
def xet() -> bool:
    """Whether the sink uploads through Xet (else LFS, the quicker one where the path does not matter)."""
    return True


@pytest.fixture
def hub_config() -> HubConfig:
    return CONFIG


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch, xet: bool, hub_config: HubConfig) -> Iterator[HubServer]:
    use_xet(monkeypatch, xet)
    with HubServer(config=hub_config) as server:
        yield server
