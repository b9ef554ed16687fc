"""Which `Backend` a sink URL opens: the local filesystem, S3, or any other fsspec store."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from stagerd.errors import ConfigError, SinkError
from stagerd.sinks.fs_open import filesystem_at
from stagerd.sinks.generic import FsspecBackend
from stagerd.sinks.local import LocalBackend
from stagerd.sinks.objects import Backend, redact_url
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
    try:
        if protocol in (None, "file", "local"):
            return LocalBackend(Path(path or "/"))
        if protocol in ("s3", "s3a"):
            return S3Backend.open(
                url, opts, part_size=part_size, max_concurrency=max_concurrency, checksum=checksum
            )
        fs, root = filesystem_at(url, opts)
        return FsspecBackend(fs, root)
    except (ValueError, ImportError, TypeError) as e:
        raise ConfigError(
            f"cannot open sink {redact_url(url)}: {type(e).__name__}: {e}",
            hint="use s3://BUCKET/PREFIX, file:///PATH, hf://ORG/REPO or an fsspec URL whose "
            "package is installed (gcsfs for gs://, adlfs for az://)",
        ) from None
    except OSError as e:  # stores that connect on open (ftp, sftp) and are down: retry later
        why = e.strerror or "connection failed"
        raise SinkError(f"cannot reach sink {redact_url(url)}: {type(e).__name__}: {why}") from None
