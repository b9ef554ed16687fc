"""An fsspec filesystem for one parsed store URL, without fsspec's chain splitting.

`fsspec.core.url_to_fs` splits a URL at every `::` to build a chain of filesystems, so an IPv6 literal host
(`sftp://[::1]/x`) falls apart into `sftp://[` and `1]/x` and fails as an "Invalid IPv6 URL". The parser
refuses real chains (`urls.py`), so a sink's URL names one store: its class reads the host, port and user
from the URL, as `url_to_fs` would for that one link. fsspec hands the host on in its brackets, which no
socket call resolves; the client is given the address itself.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

from stagerd.errors import ConfigError, SinkError
from stagerd.sinks.urls import shown, without_ipv6_host


def filesystem_at(url: str, opts: Mapping[str, Any]) -> tuple[Any, str]:
    """The filesystem of `url`'s store and the root path in it; `opts` win over what the URL says."""
    import fsspec

    if "::" in without_ipv6_host(url):
        raise ConfigError(f"{shown(url)} chains fsspec protocols", hint="name the store itself")
    protocol, _ = fsspec.core.split_protocol(url)
    cls = fsspec.get_filesystem_class(protocol)
    kwargs = dict(cls._get_kwargs_from_urls(url))
    host = kwargs.get("host")
    if isinstance(host, str) and host.startswith("[") and host.endswith("]"):
        kwargs["host"] = host[1:-1]
    return fsspec.filesystem(protocol, **{**kwargs, **opts}), cls._strip_protocol(url)


@contextlib.contextmanager
def opening(url: str) -> Iterator[None]:
    """How opening a store fails, the same for every command that opens one (publish, watch, prune,
    restore): a URL no store can take is a `ConfigError`; a store that connects on open (ftp, sftp, hdfs)
    and cannot, a `SinkError` to retry later, never a traceback. A `file://` directory that is a file, or
    lies under one, is a `ConfigError` before anything is opened (`places.refuse_a_file`)."""
    import fsspec

    from stagerd.sinks.objects import redact_url
    from stagerd.sinks.places import refuse_a_file

    protocol, path = fsspec.core.split_protocol(url)
    if protocol in (None, "file", "local"):
        refuse_a_file(url, path or "/")
    try:
        yield
    except (ValueError, ImportError, TypeError) as e:
        raise ConfigError(
            f"cannot open sink {redact_url(url)}: {type(e).__name__}: {e}",
            hint="use s3://BUCKET/PREFIX, file:///PATH, hf://ORG/REPO or an fsspec URL whose "
            "package is installed (gcsfs for gs://, adlfs for az://)",
        ) from None
    except OSError as e:
        why = e.strerror or "connection failed"  # str(e) may quote the URL, password and all
        raise SinkError(f"cannot reach sink {redact_url(url)}: {type(e).__name__}: {why}") from None


@contextlib.contextmanager
def opening_again(url: str) -> Iterator[None]:
    """Opening again, while the daemon runs, a store it opened at start (the fleet's exchange, for each
    step): the URL was taken then, so a `ConfigError` now (a file where its directory was) is the store
    changed under the daemon, an outage retried as for a sink opened once (`local_dirs.LocalTree.held`),
    never a step quarantined for what its store became."""
    try:
        yield
    except ConfigError as e:
        raise SinkError(e.message, path=e.path or url, hint=e.hint) from None
