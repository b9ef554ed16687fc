"""The Hub sink's options: those a URL's query (`hf://ORG/REPO[@REVISION]?k=v...`) or a keyword may set,
checked and read into `HubSink`'s arguments (see the package docstring for each)."""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Any

from stagerd.errors import ConfigError
from stagerd.sinks.hub.timeouts import HubTimeouts
from stagerd.sinks.hub.url import RetryPolicy, _as_bool, _number, parse_hub_url

KNOWN = frozenset(
    {"token", "endpoint", "private", "branch_per_step", "max_attempts", "backoff_base"}
    | {"backoff_max", "max_retry_after", "hash_threads", "num_threads", "retry"}
    | {"timeout", "connect_timeout"}
)


def sink_arguments(url: str, options: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """(repo id, `HubSink` keyword arguments) for `url`; `options` override its query. An unknown or
    malformed option is a ConfigError naming it (and the URL without its query)."""
    target = parse_hub_url(url)
    opts: dict[str, Any] = {**target.options, **options}
    unknown = sorted(set(opts) - KNOWN)
    if unknown:
        named = ", ".join(_with_closest(k) for k in unknown)
        raise ConfigError(f"unknown Hub sink option(s) {named} for {target.redacted}")
    retry = opts.get("retry") or RetryPolicy(
        max_attempts=_number(opts, "max_attempts", RetryPolicy.max_attempts, int),
        backoff_base=_number(opts, "backoff_base", RetryPolicy.backoff_base, float),
        backoff_max=_number(opts, "backoff_max", RetryPolicy.backoff_max, float),
        max_retry_after=_number(opts, "max_retry_after", RetryPolicy.max_retry_after, float),
    )
    timeouts = HubTimeouts(
        read=_number(opts, "timeout", HubTimeouts.read, float),
        connect=_number(opts, "connect_timeout", HubTimeouts.connect, float),
    )
    return target.repo_id, {
        "revision": target.revision,
        "token": opts.get("token"),
        "endpoint": opts.get("endpoint"),
        "private": _as_bool("private", opts.get("private", True)),
        "branch_per_step": _as_bool("branch_per_step", opts.get("branch_per_step", False)),
        "retry": retry,
        "hash_threads": _number(opts, "hash_threads", 2, int),
        "num_threads": _number(opts, "num_threads", 5, int),
        "timeouts": timeouts,
    }


def _with_closest(name: str) -> str:
    """`name`, with the known option a typo of it meant: `endpont (did you mean endpoint?)`."""
    close = difflib.get_close_matches(name.lower().replace("-", "_"), sorted(KNOWN), n=1)
    return f"{name} (did you mean {close[0]}?)" if close else name
