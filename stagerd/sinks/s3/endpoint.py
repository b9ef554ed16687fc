"""The S3 endpoint checked when the sink opens, before any client is made.

botocore takes an endpoint without a scheme (`minio:9000`, the common MinIO mistake) for a malformed URL
only when the first request builds the client, as a bare `ValueError`, and one with another scheme
(`ftp://x`) as an endpoint-resolution error that reads like an outage. Neither passes on retry, so each is
a `ConfigError` naming where the endpoint came from, raised before anything is written.
"""

from __future__ import annotations

import os
import urllib.parse
from collections.abc import Mapping
from typing import Any

from stagerd.errors import ConfigError

# botocore's own order: the client's argument, then the S3-only variable, then the generic one
_ENV = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")


def endpoint_source(opts: Mapping[str, Any]) -> tuple[str, str] | None:
    """The endpoint the S3 client will use and what set it (an option or a variable), or None for AWS's."""
    client_kwargs = opts.get("client_kwargs") or {}
    if opts.get("endpoint_url"):
        return str(opts["endpoint_url"]), "the storage option endpoint_url"
    if isinstance(client_kwargs, Mapping) and client_kwargs.get("endpoint_url"):
        return str(client_kwargs["endpoint_url"]), "the storage option client_kwargs.endpoint_url"
    if os.environ.get("AWS_IGNORE_CONFIGURED_ENDPOINT_URLS", "").lower() == "true":
        return None
    for name in _ENV:
        if os.environ.get(name):
            return os.environ[name], name
    return None


def check_endpoint(opts: Mapping[str, Any]) -> None:
    """A `ConfigError` for an endpoint that is not `http(s)://HOST[:PORT][/PATH]`."""
    found = endpoint_source(opts)
    if found is None:
        return
    url, source = found
    why = _problem(url)
    if why is None:
        return
    if "://" not in url:
        hint = f"give the scheme: http://{url} (or https://{url} where the store serves TLS)"
    else:
        hint = "an S3 endpoint is http://HOST:PORT or https://HOST, e.g. http://minio:9000"
    raise ConfigError(f"{source}={url!r} {why}", hint=hint + "; nothing was written")


def _problem(url: str) -> str | None:
    if "://" not in url:
        return "has no scheme"
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port  # noqa: B018  # a port that is no number raises here
    except ValueError as e:
        return f"is not a valid URL: {e}"
    if parts.scheme.lower() not in ("http", "https"):
        return f"has the scheme {parts.scheme}://, not http:// or https://"
    if not parts.hostname:
        return "names no host"
    from botocore.utils import is_valid_endpoint_url, is_valid_ipv6_endpoint_url

    if not (is_valid_endpoint_url(url) or is_valid_ipv6_endpoint_url(url)):
        return "is not a valid endpoint URL"
    return None
