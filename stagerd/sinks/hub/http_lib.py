"""The HTTP library huggingface_hub sends its requests with, as `httpx`: httpx2 from huggingface_hub 2.0 on,
httpx before. transformers 5.17 and older hold huggingface_hub below 2.0, so both are in use beside a
trainer. The sink catches that library's errors and hooks that library's client: another one's classes
would match nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import httpx2 as httpx
else:
    from huggingface_hub import __version__ as _hub_version

    if int(_hub_version.split(".", 1)[0]) >= 2:
        import httpx2 as httpx
    else:
        import httpx

__all__ = ["httpx"]
