"""Sinks: where exports are published. See `base.Sink`."""

from stagerd.sinks.base import ProgressFn, PublishResult, Sink

__all__ = ["ProgressFn", "PublishResult", "Sink"]
