"""The options an export was made with, recorded beside it (`export.options.json`), and how those asked
now differ: what decides whether an export there is taken as it is, rebuilt, or a named mismatch."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from stagerd.contract import layout
from stagerd.contract.adopt.checks import CHECKS_KEY
from stagerd.contract.json_fields import loads

# An adopted export's extras (name -> sha256), recorded since this build: an export recorded before it
# is compared without them, not rebuilt for their absence.
EXTRAS_KEY = "extras"


def changed_options(recorded: Mapping[str, Any], wanted: Mapping[str, Any]) -> dict[str, Any]:
    """The options `wanted` sets otherwise than `recorded` (the checks' version aside: see `recheck`)."""
    changed = {
        k: v
        for k, v in wanted.items()
        if k != CHECKS_KEY and recorded.get(k) != v and (k != EXTRAS_KEY or k in recorded)
    }
    return changed | {k: None for k in recorded if k not in wanted and k not in (CHECKS_KEY, EXTRAS_KEY)}


def changed_text(recorded: Mapping[str, Any], changed: Mapping[str, Any]) -> str:
    def one(key: str, value: Any) -> str:
        if key != EXTRAS_KEY:
            return f"{key} {recorded.get(key)!r} -> {value!r}"
        was = recorded.get(key) or {}
        differ = sorted(n for n in {*was, *value} if was.get(n) != value.get(n))
        return f"extras {', '.join(differ)} given, changed or gone since"

    return ", ".join(one(k, v) for k, v in changed.items())


def recorded_options(step_dir: Path) -> dict[str, Any] | None:
    try:
        recorded = loads((step_dir / layout.EXPORT_OPTIONS_NAME).read_text())
    except (FileNotFoundError, ValueError):
        return None  # an export from before options were recorded, or a torn write: trusted as it is
    return recorded if isinstance(recorded, dict) else None
