"""Sinks: where exports are published. See `base.Sink`; `open_sink` picks one from a URL that
`urls.parse_sink_url` has checked."""

from __future__ import annotations

from typing import Any

from stagerd.sinks.base import ProgressFn, PublishResult, Sink
from stagerd.sinks.urls import SinkKind, SinkUrl, parse_sink_url

__all__ = ["ProgressFn", "PublishResult", "Sink", "SinkKind", "SinkUrl", "open_sink", "parse_sink_url"]


def open_sink(url: str, **options: Any) -> Sink:
    """The sink for `url`, refused with a ConfigError unless `parse_sink_url` accepts it: `hf://ORG/REPO[@REV]`
    is the Hub; `s3://`, `file:///PATH` (or `/PATH`) and other durable fsspec URLs go to `FsspecSink`
    (which takes `storage_options=`, `part_size=`, `max_concurrency=`)."""
    checked = parse_sink_url(url)
    if checked.kind is SinkKind.HUB:
        from stagerd.sinks.hub import HubSink

        return HubSink.from_url(url, **options)
    from stagerd.sinks.fsspec import FsspecSink

    return FsspecSink.from_url(url, **options)
