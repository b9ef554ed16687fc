"""The small JSON file `StagerdCheckpointIO` writes at each Lightning checkpoint path: it names the ROOT
and the step that holds the checkpoint, and the top-level keys Lightning's own file would hold there.
Read bounded (`MAX_POINTER_BYTES`); any other file is no pointer.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NamedTuple

from stagerd.contract import layout
from stagerd.errors import LoadError
from stagerd.training.step_choice import committed_text, holds

POINTER = "stagerd.lightning.pointer/1"
MAX_POINTER_BYTES = 64 << 10
NOT_OURS_HINT = (
    "give a path StagerdCheckpointIO wrote (ModelCheckpoint's), a committed ROOT/step-N or ROOT; a "
    "Lightning .ckpt file of its own loads without the plugin (with cls.load_from_checkpoint)"
)


class Located(NamedTuple):
    root: Path
    step: int
    keys: frozenset[str] | None  # at a pointer path, the top-level keys its checkpoint holds; else None


def locate(path: Path) -> Located:
    """ROOT, step and kept keys of a pointer file, a step directory, or ROOT (its newest committed step).
    The keys are None where the whole step is meant (a step directory, ROOT, a file written before they
    were recorded)."""
    data = _read_pointer(path)
    if data is not None:
        root, named = _where(data, path)
        if not layout.is_committed(root / layout.step_dir_name(named)):
            raise _gone(path, root, named)
        return Located(root, named, _keys(data, path))
    step = layout.parse_step_dir(path.name)
    if step is not None and layout.is_committed(path):
        return Located(path.parent, step, None)
    # the first run of a script that resumes from ROOT
    fresh = ": a fresh run has nothing to load (Trainer.fit: pass ckpt_path=None)"
    if not path.exists():
        near = layout.closest_existing(path)  # a typo'd path reads as one
        meant = f"; did you mean {near}?" if near is not None else ""
        raise LoadError(f"does not exist{meant}{fresh}", path=path, hint=NOT_OURS_HINT)
    if path.is_dir():
        steps = layout.committed_steps(path)
        if steps:
            return Located(path, steps[-1][0], None)
        if step is None and _only_stagerds(path):
            raise LoadError(f"no committed step under this ROOT yet{fresh}", path=path, hint=NOT_OURS_HINT)
    raise LoadError(
        "not a stagerd checkpoint: neither a StagerdCheckpointIO file, nor a committed step, nor a ROOT "
        "with one",
        path=path,
        hint=NOT_OURS_HINT,
    )


def _gone(path: Path, root: Path, step: int) -> LoadError:
    """The step a pointer names is not committed in its ROOT: the daemon's `--keep-last` (or a person)
    deleted it, or ROOT moved. Said as `Stager.load` says a step that is not there, not as a step whose
    marker is missing."""
    steps = [s for s, _ in layout.committed_steps(root)] if root.is_dir() else []
    where = committed_text(steps[::-1]) if steps else holds(root)
    return LoadError(
        f"names step {step} of {root}, which is not committed there; {where}",
        path=path,
        hint="a step the daemon's --keep-last deleted comes back from a sink it was published on "
        f"(`stagerd restore URL {root} --step {step}`); or load ROOT (its newest step) or ROOT/step-N",
    )


def _only_stagerds(path: Path) -> bool:
    """A directory that is empty or holds only what a Stager writes (steps in progress, `.stagerd`, locks):
    a ROOT; a directory of other files (ModelCheckpoint's own, say) is no ROOT at all."""
    try:
        return all(p.name.startswith((".", "step-")) for p in path.iterdir())
    except OSError:
        return False


def pointed(path: Path) -> tuple[Path, int] | None:
    """(ROOT, step) of a pointer file, None for any other file."""
    data = _read_pointer(path)
    return None if data is None else _where(data, path)


def _where(data: dict[str, Any], path: Path) -> tuple[Path, int]:
    step, root = data.get("step"), data.get("root")
    if not isinstance(step, int) or not isinstance(root, str):
        raise LoadError("a malformed StagerdCheckpointIO file", path=path)
    return Path(root), step


def _keys(data: dict[str, Any], path: Path) -> frozenset[str] | None:
    keys = data.get("keys")
    if keys is None:
        return None
    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
        raise LoadError("a malformed StagerdCheckpointIO file", path=path)
    return frozenset(keys)


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
