"""The object whose method is calling: for hooks whose events do not pass their owner (a Trainer's
callbacks, a Lightning plugin's calls), the nearest calling frame whose `self` is of the kind asked."""

from __future__ import annotations

import sys
from typing import TypeVar

T = TypeVar("T")


def calling_self(kind: type[T]) -> T | None:
    """The `self` of the nearest frame above the caller's that is a `kind`, else None."""
    frame = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, kind):
            return owner
        frame = frame.f_back  # type: ignore[assignment]
    return None
