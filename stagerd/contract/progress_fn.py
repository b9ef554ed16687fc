"""The progress callback every long operation takes: called with (bytes done, bytes in all)."""

from __future__ import annotations

from collections.abc import Callable

ProgressFn = Callable[[int, int], None]
