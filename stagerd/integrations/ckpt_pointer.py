"""The small JSON file `StagerdCheckpointIO` writes at each Lightning checkpoint path: it names the ROOT
and the step that holds the checkpoint, and the top-level keys Lightning's own file would hold there.
Read bounded (`MAX_POINTER_BYTES`); any other file is no pointer.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from stagerd.contract import layout
from stagerd.errors import LoadError

POINTER = "stagerd.lightning.pointer/1"
MAX_POINTER_BYTES = 64 << 10


def locate(path: Path) -> tuple[Path, int]:
    """(ROOT, step) of a pointer file, a step directory, or ROOT (its newest committed step)."""
    pointer = pointed(path)
    if pointer is not None:
        return pointer
    step = layout.parse_step_dir(path.name)
    if step is not None and layout.is_committed(path):
        return path.parent, step
    if path.is_dir():
        steps = layout.committed_steps(path)
        if steps:
            return path, steps[-1][0]
    raise LoadError(
        "not a stagerd checkpoint: neither a StagerdCheckpointIO file, nor a committed step, nor a ROOT "
        "with one",
        path=path,
    )


def pointed(path: Path) -> tuple[Path, int] | None:
    data = _read_pointer(path)
    if data is None:
        return None
    step, root = data.get("step"), data.get("root")
    if not isinstance(step, int) or not isinstance(root, str):
        raise LoadError("a malformed StagerdCheckpointIO file", path=path)
    return Path(root), step


def pointer_keys(path: Path) -> set[str] | None:
    """The top-level keys of the checkpoint saved at `path` (None: a file written before they were
    recorded, or not a pointer: the whole step)."""
    data = _read_pointer(path)
    keys = None if data is None else data.get("keys")
    if keys is None:
        return None
    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
        raise LoadError("a malformed StagerdCheckpointIO file", path=path)
    return set(keys)


def _read_pointer(path: Path) -> dict[str, Any] | None:
    try:
        if not path.is_file() or path.stat().st_size > MAX_POINTER_BYTES:
            return None
        data = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return None
    except RecursionError:  # 64 KiB of `[` is JSON nested past the interpreter's stack
        raise LoadError(
            "a checkpoint file of JSON nested too deep to read: no StagerdCheckpointIO file",
            path=path,
            hint="give load_checkpoint (or fit's ckpt_path) a file StagerdCheckpointIO wrote, a step "
            "directory or ROOT; nothing was loaded",
        ) from None
    if not isinstance(data, dict) or data.get("format") != POINTER:
        return None
    return data
