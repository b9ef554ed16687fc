"""The staging root's layout, shared by the training side and the daemon: the names in a step directory,
step directory names and listing, relative-path checks, and atomic writes (the commit marker:
`commit_marker.py`; the export manifest: `manifest.py`). This module must not import torch: the daemon
reads it on every scan.
"""

from __future__ import annotations

import contextlib
import difflib
import itertools
import json
import os
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from stagerd.errors import MarkerError

MARKER_NAME = "stagerd.commit.json"
MANIFEST_NAME = "stagerd.manifest.json"
MANIFEST_FORMAT = "stagerd.manifest/1"
MODEL_DIR = "model"
EXTRAS_DIR = "extras"
OPTIM_DIR = "optim"
EXPORT_DIR = "export"
EXPORT_TMP_DIR = "export.tmp"
EXPORT_OPTIONS_NAME = "export.options.json"  # beside export/, never published: what the export was made with
STATE_DIR = ".stagerd"
INDEX_NAME = "model.safetensors.index.json"
ADAPTER_WEIGHTS_NAME = "adapter_model.safetensors"  # PeftModel.save_pretrained's one file of weights
WEIGHTS_NAME = "model.safetensors"  # an export that fits one file: that file, and no index
ADAPTER_DIR = "adapter"  # export/adapter/: a PEFT model's adapter-only artefact, beside its merged export
BEST_STEPS_NAME = "stagerd.best.json"  # in extras/: the best steps for retention (`best_steps.py`)

# What a save, a restore and the daemon write at the top of a step directory (and their temp names,
# `.NAME.tmp-...`, and a LoRA merge's scratch, `.stagerd-merge-...`): any other name there is the user's.
STEP_NAMES = frozenset(
    {MODEL_DIR, OPTIM_DIR, EXTRAS_DIR, MARKER_NAME, EXPORT_DIR, EXPORT_TMP_DIR, EXPORT_OPTIONS_NAME}
)
_STEP_TEMP_RE = re.compile(
    r"\.(?:" + "|".join(re.escape(n) for n in sorted(STEP_NAMES)) + r")\.tmp-.+|\.stagerd-merge-.+"
)


def exported_extra(rel: str) -> bool:
    """Whether `extras/rel` is copied into the export: not an index or weights (the export's own would
    contradict them), nor the record of the best steps (retention's, not the model's)."""
    return rel not in (INDEX_NAME, BEST_STEPS_NAME) and not rel.endswith(".safetensors")


def foreign_names(step_dir: str | os.PathLike[str]) -> list[str]:
    """The names at the top of `step_dir` that no save, restore or daemon writes (a user's own files), sorted:
    what removes or replaces a step directory whole must leave those."""
    return sorted(n for n in os.listdir(step_dir) if n not in STEP_NAMES and not _STEP_TEMP_RE.fullmatch(n))


def a_few(names: list[str], most: int = 3) -> str:
    """`a, b, c and 2 more`: the first `most` of `names`, for a one-line message."""
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")


# Steps are SQLite INTEGERs in the daemon's journal, and int64 wherever else they travel.
MAX_STEP = 2**63 - 1
_STEP_DIR_RE = re.compile(r"step-([0-9]{8,19})")


def step_dir_name(step: int) -> str:
    """`step-00000100` for step 100: zero-padded so names sort by step."""
    if not 0 <= step <= MAX_STEP:
        raise ValueError(f"step must be between 0 and 2^63 - 1, got {step}")
    return f"step-{step:08d}"


def parse_step_dir(name: str) -> int | None:
    """The step number of a step directory name, or None if it is not one.

    Only the exact names `step_dir_name` writes count: ASCII digits, 8 of them or as few beyond that as the
    number needs, no trailing newline. `step-000000100` and `step-00000100` would otherwise both be step
    100, and one of them would be ignored.
    """
    m = _STEP_DIR_RE.fullmatch(name)
    if m is None:
        return None
    step = int(m.group(1))
    return step if step <= MAX_STEP and name == step_dir_name(step) else None


def why_a_step_dir(d: Path) -> str | None:
    """Why the directory `d` is a step directory, not a ROOT or a user's own: it holds the commit marker,
    or is named as a step with `model/` inside (a save in progress); None where it is neither. A trainer's
    own `step-N` checkpoint (torchtitan's, no `model/`) is none: its parent is a ROOT to `--adopt`."""
    if (d / MARKER_NAME).is_file():
        return f"it holds {MARKER_NAME}"
    if parse_step_dir(d.name) is not None and (d / MODEL_DIR).is_dir():
        return f"it is named {d.name} with {MODEL_DIR}/ inside"
    return None


def nearest_existing(path: str | os.PathLike[str]) -> Path:
    """`path` made absolute, or the nearest directory above it that is there (a link, even a dangling
    one, is): where making `path` starts, and what must be a directory for it to be made."""
    p = Path(os.path.abspath(path))
    while not os.path.lexists(p) and p != p.parent:
        p = p.parent
    return p


# The most entries of a directory looked through for a name like a missing one: a directory of millions of
# files is not listed for a hint.
_MAX_SIBLINGS = 10_000


def closest_existing(path: str | os.PathLike[str], *, made: bool = False) -> Path | None:
    """`path` with its first missing part replaced by the most alike directory beside it
    (`/data/checkpoint` -> `/data/checkpoints`; a step named with another zero padding, `step-6`, by that
    step's directory, `step-00000006`, where it is there): the path a typo meant, or None where none is alike
    (or the parent cannot be read). `made`: the last part exists only because it was just made for this
    path (a Stager's new ROOT), so it is looked for beside itself too."""
    parts = Path(os.path.abspath(path)).parts
    for i in range(1, len(parts)):
        parent, missing = Path(*parts[:i]), parts[i]
        if (parent / missing).exists() and not (made and i == len(parts) - 1):
            continue
        padded = _padded_step(parent, missing)
        if padded is not None:
            return parent.joinpath(padded, *parts[i + 1 :])
        try:
            with os.scandir(parent) as it:
                names = [
                    e.name for e in itertools.islice(it, _MAX_SIBLINGS) if e.is_dir() and e.name != missing
                ]
        except OSError:
            return None
        close = difflib.get_close_matches(missing, names, n=1, cutoff=0.75)
        return parent.joinpath(close[0], *parts[i + 1 :]) if close else None
    return None


def _padded_step(parent: Path, name: str) -> str | None:
    """The name of the step directory in `parent` that `name` gives with another zero padding, or None."""
    m = re.fullmatch(r"step-0*([0-9]{1,19})", name)
    if m is None or int(m[1]) > MAX_STEP:
        return None
    real = step_dir_name(int(m[1]))
    return real if real != name and (parent / real).is_dir() else None


def looks_like_a_step_dir(name: str) -> bool:
    """A name a person meant as a step directory that `parse_step_dir` refuses (to warn about, once)."""
    return name.startswith("step-") and parse_step_dir(name) is None


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """fsync a directory so a rename inside it is durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_bytes_atomic(
    path: str | os.PathLike[str], data: bytes, *, exclusive: bool = False, tmp: Path | None = None
) -> None:
    """Write to a temp name, fsync, rename over `path`, fsync the directory. `exclusive`: link instead of
    rename, so a `path` already there stays and `FileExistsError` says so. `tmp`: the temp name, where
    its writer must be told apart from others' (a sink shared by several hosts).

    The temp name holds the thread too: two threads of one process writing one path (a fleet node's raw
    part moving `raw/latest` beside another's) must not rename each other's temp file away."""
    path = Path(path)
    if tmp is None:
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    # The name is predictable: one already there (a dead writer's of this pid and thread, or a link placed
    # there) is removed, never written through; O_EXCL then makes the file ours.
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        if exclusive:
            try:
                os.link(tmp, path)
            finally:
                os.unlink(tmp)
        else:
            os.replace(tmp, path)
    except BaseException:
        # A full disk must leave no half-written temp file behind to hold its last pages.
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


def write_json_atomic(path: str | os.PathLike[str], obj: Any) -> None:
    """Atomically write `obj` as indented JSON."""
    write_bytes_atomic(path, (json.dumps(obj, indent=2, sort_keys=False) + "\n").encode())


def safe_relpath(rel: str, *, what: str, path: object) -> str:
    """Reject absolute paths, `..`, empty parts and control characters in a relative path."""
    if not isinstance(rel, str) or not rel or rel.startswith("/") or "\\" in rel:
        raise MarkerError(f"{what} {rel!r} is not a relative path", path=path)
    parts = rel.split("/")
    if any(p in ("", ".", "..") for p in parts) or any(ord(c) < 32 for c in rel):
        raise MarkerError(f"{what} {rel!r} escapes its directory", path=path)
    return rel


def check_file_tree(rels: list[str], *, what: str, path: object) -> None:
    """Refuse a list of files that cannot all exist in one directory: a name listed twice, or one listed both
    as a file and as a directory of another (`a` and `a/b`). Written by someone else, such a list would
    otherwise fail half way through creating them, or count one file twice."""
    seen: set[str] = set()
    for rel in rels:
        if rel in seen:
            raise MarkerError(f"{what} {rel!r} is listed twice", path=path)
        seen.add(rel)
    for rel in rels:
        parts = rel.split("/")
        for i in range(1, len(parts)):
            if (d := "/".join(parts[:i])) in seen:
                raise MarkerError(f"{what} {d!r} is listed, and so is {rel!r} inside it", path=path)


def is_committed(step_dir: str | os.PathLike[str]) -> bool:
    return (Path(step_dir) / MARKER_NAME).is_file()


def iter_step_dirs(root: str | os.PathLike[str]) -> Iterator[tuple[int, Path]]:
    """(step, path) of every step directory under root, committed or not, in step order."""
    found = []
    try:
        entries = list(os.scandir(root))
    except FileNotFoundError:
        return iter(())
    for e in entries:
        step = parse_step_dir(e.name)
        if step is not None and e.is_dir(follow_symlinks=False):
            found.append((step, Path(e.path)))
    return iter(sorted(found))


def committed_steps(root: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """(step, path) of every committed step under root, in step order."""
    return [(s, p) for s, p in iter_step_dirs(root) if is_committed(p)]


def export_is_whole(export_dir: Path) -> bool:
    """Whether `export_dir` holds an export's weights: its index, or the one `model.safetensors` of an
    export that fits one file (only stagerd writes `export/`, always by rename, so either means whole)."""
    return any((export_dir / n).is_file() for n in (INDEX_NAME, WEIGHTS_NAME, ADAPTER_WEIGHTS_NAME))
