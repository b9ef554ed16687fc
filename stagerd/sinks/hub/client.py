"""The huggingface_hub client and request headers every Hub call of stagerd's goes through, so that each
names stagerd and its version in its User-Agent: the sink's, a restore's, and the raw history reads."""

from __future__ import annotations

from typing import TYPE_CHECKING

from stagerd import __version__

if TYPE_CHECKING:
    from huggingface_hub import HfApi


def hub_api(endpoint: str | None, token: str | bool | None) -> HfApi:
    """An `HfApi` at `endpoint` (None: HF_ENDPOINT or the Hub) with `token` (None: HF_TOKEN or the login)."""
    from huggingface_hub import HfApi

    return HfApi(endpoint=endpoint, token=token, library_name="stagerd", library_version=__version__)


def hub_headers(token: str | bool | None) -> dict[str, str]:
    """The headers huggingface_hub sends with `token`, for the requests stagerd makes itself."""
    from huggingface_hub.utils import build_hf_headers

    return build_hf_headers(token=token, library_name="stagerd", library_version=__version__)
