"""The S3 endpoint checked when the sink opens, before any client is made.

botocore takes an endpoint without a scheme (`minio:9000`, the common MinIO mistake) for a malformed URL
only when the first request builds the client, as a bare `ValueError`, and one with another scheme
(`ftp://x`) as an endpoint-resolution error that reads like an outage. Neither passes on retry, so each is
a `ConfigError` naming where the endpoint came from, raised before anything is written.

The endpoint is looked for where botocore looks, in its order: the storage options, AWS_ENDPOINT_URL_S3,
AWS_ENDPOINT_URL, then the AWS config file (`AWS_CONFIG_FILE`, else `~/.aws/config`) under the profile in
use: the s3 `endpoint_url` of the `[services NAME]` section the profile names, then the profile's own
`endpoint_url`. The file is read by botocore itself, so it is the file and profile the client will use.
"""

from __future__ import annotations

import os
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from stagerd.errors import ConfigError
from stagerd.sinks.url_text import masked

# botocore's own order: the client's argument, then the S3-only variable, then the generic one
_ENV = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")


@dataclass(frozen=True)
class Endpoint:
    url: str
    source: str  # what set it, as the message names it: an option, a variable, a config file's key
    path: str | None = None  # the config file that set it


def endpoint_source(opts: Mapping[str, Any]) -> Endpoint | None:
    """The endpoint the S3 client will use and what set it, or None for AWS's own."""
    client_kwargs = opts.get("client_kwargs") or {}
    if opts.get("endpoint_url"):
        return Endpoint(str(opts["endpoint_url"]), "the storage option endpoint_url")
    if isinstance(client_kwargs, Mapping) and client_kwargs.get("endpoint_url"):
        return Endpoint(str(client_kwargs["endpoint_url"]), "the storage option client_kwargs.endpoint_url")
    import botocore.exceptions
    import botocore.session

    # the session s3fs gives the client: the profile of the storage option `profile`, else AWS_PROFILE's
    session = botocore.session.Session(profile=opts.get("profile") or None)
    try:
        if session.get_config_variable("ignore_configured_endpoint_urls"):
            return None  # by AWS_IGNORE_CONFIGURED_ENDPOINT_URLS or the profile: botocore uses none of them
        for name in _ENV:
            if os.environ.get(name):
                return Endpoint(os.environ[name], name)
        scoped = session.get_scoped_config()
    except (botocore.exceptions.ProfileNotFound, botocore.exceptions.ConfigParseError):
        return None  # the client names these itself
    path = os.path.expanduser(str(session.get_config_variable("config_file")))
    profile = session.profile or "default"
    section = scoped.get("services")
    if isinstance(section, str):
        services = session.full_config.get("services", {}).get(section)
        s3 = services.get("s3") if isinstance(services, Mapping) else None
        if isinstance(s3, Mapping) and s3.get("endpoint_url"):
            where = f"the s3 endpoint_url of [services {section}] (profile {profile}'s services)"
            return Endpoint(str(s3["endpoint_url"]), where, path)
    if scoped.get("endpoint_url"):
        return Endpoint(str(scoped["endpoint_url"]), f"the endpoint_url of profile {profile}", path)
    return None


def check_endpoint(opts: Mapping[str, Any]) -> None:
    """A `ConfigError` for an endpoint that is not `http(s)://HOST[:PORT][/PATH]`."""
    found = endpoint_source(opts)
    if found is None:
        return
    url = found.url
    why = _problem(url)
    if why is None:
        return
    shown = masked(url)
    if "://" not in url:
        hint = f"give the scheme: http://{shown} (or https://{shown} where the store serves TLS)"
    elif why == _CREDENTIALS:
        hint = (
            "give the keys as AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or a profile) and the endpoint "
            "without them, e.g. http://minio:9000"
        )
    else:
        hint = "an S3 endpoint is http://HOST:PORT or https://HOST, e.g. http://minio:9000"
    raise ConfigError(f"{found.source}={shown!r} {why}", path=found.path, hint=hint + "; nothing was written")


# botocore refuses every request to such an endpoint, which would read as a sink that is down for ever
_CREDENTIALS = "carries credentials (USER:PASSWORD@), which S3 never takes from the endpoint"


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
    if "@" in parts.netloc:
        return _CREDENTIALS
    from botocore.utils import is_valid_endpoint_url, is_valid_ipv6_endpoint_url

    if not (is_valid_endpoint_url(url) or is_valid_ipv6_endpoint_url(url)):
        return "is not a valid endpoint URL"
    return None
