"""Which `Backend` a sink URL opens: the local filesystem, S3, or any other fsspec store."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from stagerd.sinks.fs_open import filesystem_at, opening
from stagerd.sinks.generic import FsspecBackend
from stagerd.sinks.local import LocalBackend
from stagerd.sinks.objects import Backend
from stagerd.sinks.s3.backend import S3Backend


def open_backend(
    url: str, opts: Mapping[str, Any], *, part_size: int, max_concurrency: int, checksum: str
) -> Backend:
    """The store behind `url`; `opts` go to the fsspec filesystem (see `FsspecSink.from_url`). A URL no
    store can take is a `ConfigError`; a store that connects on open and is down, a `SinkError`."""
    import fsspec

    from stagerd.sinks.urls import refuse_patterns

    refuse_patterns(url)  # also where a sink is opened without the parser (the fleet's exchange)
    protocol, path = fsspec.core.split_protocol(url)
    with opening(url):
        if protocol in (None, "file", "local"):
            return LocalBackend(Path(path or "/"))
        if protocol in ("s3", "s3a"):
            return S3Backend.open(
                url, opts, part_size=part_size, max_concurrency=max_concurrency, checksum=checksum
            )
        fs, root = filesystem_at(url, opts)
        return FsspecBackend(fs, root)
