"""Request bounds: huggingface_hub shares one HTTP client per process with no timeout, so a request hook
bounds each request by the timeouts of the sink registered for its endpoint."""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from functools import reduce
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from stagerd.errors import (
    ConfigError,
)

if TYPE_CHECKING:
    from stagerd.sinks.hub.http_lib import httpx


# --- request bounds -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class HubTimeouts:
    """How long one Hub request may wait: `connect` for the connection, `read` for anything else.

    `read` also bounds waiting to send more of an upload (the server stopped reading) and waiting for a
    free connection of the shared pool.
    """

    read: float = 60.0
    connect: float = 10.0

    def __post_init__(self) -> None:
        for name in ("read", "connect"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not 0 < value < float("inf"):
                raise ConfigError(
                    f"Hub sink {name} timeout must be a positive number of seconds, got {value!r}"
                )

    def limits(self) -> dict[str, float]:
        """The bound of each of httpx's four timeouts."""
        return {"connect": self.connect, "read": self.read, "write": self.read, "pool": self.read}

    def widest(self, other: HubTimeouts) -> HubTimeouts:
        return HubTimeouts(max(self.read, other.read), max(self.connect, other.connect))


# owner (a HubSink) -> (origin, its bound). Weak, so a sink that is gone no longer widens anyone's bound.
_BOUNDS: weakref.WeakKeyDictionary[object, tuple[str, HubTimeouts]] = weakref.WeakKeyDictionary()
_BOUNDS_LOCK = threading.Lock()
_hook_installed = False
_DEFAULT_PORTS = {"http": 80, "https": 443}


def _origin(scheme: str, host: str | None, port: int | None) -> str:
    scheme = scheme.lower()
    return f"{scheme}://{(host or '').lower()}:{port or _DEFAULT_PORTS.get(scheme, 0)}"


def register_timeouts(owner: object, endpoint: str, timeouts: HubTimeouts) -> None:
    """Bound every huggingface_hub request of this process to `endpoint` by `timeouts`, while `owner` lives.

    Two owners on one endpoint get the wider of their bounds (the HTTP client is shared, so one cannot be
    stricter than the other). The first call installs the request hook.
    """
    global _hook_installed
    parts = urlsplit(endpoint)
    with _BOUNDS_LOCK:
        _BOUNDS[owner] = (_origin(parts.scheme, parts.hostname, parts.port), timeouts)
        if not _hook_installed:
            _install_request_hook()
            _hook_installed = True


def unregister_timeouts(owner: object) -> None:
    """Forget `owner`'s bound (requests stay bounded: by other owners' bounds, else the defaults)."""
    with _BOUNDS_LOCK:
        _BOUNDS.pop(owner, None)


def _bound_for(origin: str) -> HubTimeouts:
    with _BOUNDS_LOCK:
        entries = list(_BOUNDS.values())
    # LFS uploads go to URLs the Hub hands out (a CDN, a bucket) that no sink can name in advance: those
    # get the widest bound of any sink.
    pool = [t for o, t in entries if o == origin] or [t for _, t in entries] or [HubTimeouts()]
    return reduce(HubTimeouts.widest, pool)


def _bound_request(request: httpx.Request) -> None:
    """httpx request hook: no timeout of `request` is unset or above the bound of its origin."""
    url = request.url
    bound = _bound_for(_origin(url.scheme, url.host, url.port)).limits()
    asked = request.extensions.get("timeout") or {}
    request.extensions["timeout"] = {
        k: limit if asked.get(k) is None else min(asked[k], limit) for k, limit in bound.items()
    }


def _install_request_hook() -> None:
    """Make every client huggingface_hub creates from now on carry `_bound_request`, and leave a sink's
    failed requests to the sink's own retries (`one_policy.py`)."""
    from huggingface_hub import set_client_factory
    from huggingface_hub.utils import _http

    from stagerd.sinks.hub.one_policy import attach

    # Wrap the factory in place (the library's default, or one the application set for proxies or
    # certificates) instead of replacing it; 2.4 has no public getter for it.
    previous = getattr(_http, "_GLOBAL_CLIENT_FACTORY", _http.default_client_factory)

    def factory() -> httpx.Client:
        client = previous()
        client.event_hooks["request"].append(_bound_request)
        attach(client)
        return client

    set_client_factory(factory)
