"""The `Sink` protocol: where a finished export goes.

A sink is synchronous and thread-safe; the daemon runs each sink in its own lane of worker threads, so a
slow store never blocks the event loop or another sink. Every sink is idempotent: publishing a step that
the destination already holds, byte for byte, uploads nothing and returns `skipped=True`. A sink returns
only after it has verified the remote against the export (names, sizes, and hashes where the store has
them); a returned `PublishResult` means the step is published.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from stagerd.contract.progress_fn import ProgressFn

__all__ = ["ProgressFn", "PublishResult", "Sink"]


@dataclass(frozen=True)
class PublishResult:
    """What one publish did. `location` is where a reader finds the step (a URL, a commit id)."""

    sink: str
    step: int
    location: str
    files: int
    bytes_total: int
    bytes_uploaded: int
    skipped: bool
    seconds: float


@runtime_checkable
class Sink(Protocol):
    """One destination. `url` is the redacted URL: safe to log and to key journal lanes by."""

    url: str

    def publish(
        self,
        export_dir: Path,
        step: int,
        *,
        metadata: Mapping[str, Any] | None = None,
        progress: ProgressFn | None = None,
    ) -> PublishResult:
        """Upload `export_dir` as `step`, verify it, and return. Raises SinkError / SinkAuthError."""
        ...

    def is_published(self, step: int) -> bool:
        """True when the destination already holds a complete, committed `step`."""
        ...

    def close(self) -> None:
        """Release connections."""
        ...
