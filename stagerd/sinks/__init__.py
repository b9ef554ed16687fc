"""Sinks: where exports are published. See `base.Sink`; `open_sink` picks one from a URL."""

from __future__ import annotations

from typing import Any

from stagerd.sinks.base import ProgressFn, PublishResult, Sink

__all__ = ["ProgressFn", "PublishResult", "Sink", "open_sink"]


def open_sink(url: str, **options: Any) -> Sink:
    """The sink for `url`: `hf://ORG/REPO[@REV]` is the Hub; `s3://`, `file://` and any other fsspec URL go
    to `FsspecSink` (which takes `storage_options=`, `part_size=`, `max_concurrency=`)."""
    if url.startswith("hf://"):
        from stagerd.sinks.hub import HubSink

        return HubSink.from_url(url, **options)
    from stagerd.sinks.fsspec import FsspecSink

    return FsspecSink.from_url(url, **options)
