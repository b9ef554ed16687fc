"""The best steps a staged step records for the daemon's retention: `extras/stagerd.best.json`,
`{"format": "stagerd.best/1", "steps": [N, ...]}`, written by Lightning's `StagerdCheckpointIO` with each
step it stages (the steps each `ModelCheckpoint` keeps then, its best and a finite top k, under that ROOT).
After the training ends, and before a resumed run pins them again, retention keeps the steps the newest
such record names. The daemon reads it as JSON, on its scan: no torch, nothing unpickled. Never exported
(`layout.exported_extra`): it is retention's, not the model's.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable

from stagerd.contract import layout
from stagerd.contract.commit_marker import is_int
from stagerd.contract.regular_file import read_regular

NAME = layout.BEST_STEPS_NAME
FORMAT = "stagerd.best/1"
MAX_BYTES = 64 << 10


def encode(steps: Iterable[int]) -> bytes:
    return (json.dumps({"format": FORMAT, "steps": sorted(set(steps))}) + "\n").encode()


def read(path: str | os.PathLike[str]) -> list[int] | None:
    """The steps the record at `path` names; None where it is unreadable or no such record."""
    try:
        raw = read_regular(path, MAX_BYTES + 1)
        data = json.loads(raw) if len(raw) <= MAX_BYTES else None
    except (OSError, ValueError, RecursionError):
        return None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        return None
    steps = data.get("steps")
    if not isinstance(steps, list) or not all(is_int(s) and 0 <= s <= layout.MAX_STEP for s in steps):
        return None
    return steps
