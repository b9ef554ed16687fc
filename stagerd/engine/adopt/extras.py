"""The extras of an adopted checkpoint (config, tokenizer, a PEFT adapter's card): each found in the first
place that has it, and never through a link where the trainer keeps it.
"""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path
from typing import Any

from stagerd.contract.adopt.presets import ADAPTER_CARD, Preset, extra_names
from stagerd.contract.regular_file import linked
from stagerd.contract.step.held import HeldDir, HeldFiles
from stagerd.engine.parsed_extras import read_json_object
from stagerd.errors import ExtrasError, open_failed

# The daemon often runs as another, more privileged user than the trainer: an extra that is a link in the
# trainer's places (`tokenizer.model -> /root/.ssh/id_ed25519`) would be copied into the export and published.
EXTRA_WHY = "extras are read from the trainer's own files, never through a link (the daemon may read more)"
EXTRA_HINT = "copy the file itself in place of the link, or pass --extras DIR holding it; nothing was sent"


def find_extras(
    ckpt: Path | HeldDir,
    preset: Preset,
    extras_dir: Path | None,
    parent: Path | HeldDir,
    files: HeldFiles | None = None,
    names: tuple[str, ...] | None = None,
) -> dict[str, Path]:
    """Each extra (`names`, else `extra_names`) from the first place that has it: where the trainer keeps
    them (the preset's `extras_dirs`), the checkpoint, --extras DIR, the checkpoint's parent. In the
    trainer's places an extra that is a link is a SymlinkError (see EXTRA_WHY); held (`ckpt` and `parent`
    HeldDirs, `files` given), each is opened there without following a link and read by its proc path.
    --extras DIR is the operator's own and followed: a Hugging Face cache snapshot is links into its
    `blobs/`."""
    places: list[Path | HeldDir | None] = [*(_place(ckpt, d, files) for d in preset.extras_dirs), ckpt]
    places += [*([extras_dir] if extras_dir is not None else []), parent]
    found: dict[str, Path] = {}
    for name in names or extra_names(preset):
        for d in places if name != ADAPTER_CARD else [ckpt]:
            if d is None:
                continue
            p = d / name if isinstance(d, Path) and d is extras_dir else _trainers(d, name, files)
            if p is not None and p.is_file():
                found[name] = p
                break
    return found


def extras_digest(ckpt: Path, preset: Preset, extras_dir: Path | None) -> dict[str, str]:
    """name -> sha256 of each extra an export of `ckpt` takes now (`find_extras`, ROOT the checkpoint's
    parent): recorded beside an adopted export and compared before a sink gets it, so a config.json given
    (`--extras DIR`) or mended since is in what the next sink gets. A file gone or unreadable meanwhile is
    left out: the export itself names it."""
    out = {}
    for name, path in sorted(find_extras(ckpt, preset, extras_dir, ckpt.parent).items()):
        try:
            with open(path, "rb") as f:
                out[name] = hashlib.file_digest(f, "sha256").hexdigest()
        except OSError:
            continue
    return out


def find_trainers_file(
    ckpt: Path | HeldDir, preset: Preset, name: str, files: HeldFiles | None = None
) -> Path | None:
    """`name` where the trainer keeps its extras (the preset's `extras_dirs`), read there only, as
    `find_extras` reads them (a link is a SymlinkError): a file of the trainer's that is never published."""
    for sub in preset.extras_dirs:
        d = _place(ckpt, sub, files)
        p = None if d is None else _trainers(d, name, files)
        if p is not None:
            return p
    return None


def _place(ckpt: Path | HeldDir, sub: str, files: HeldFiles | None) -> Path | HeldDir | None:
    """The trainer's extras directory `sub` of the checkpoint: held from it where the checkpoint is
    held (None where it is not there), its path otherwise; a link on the way is a SymlinkError."""
    if not isinstance(ckpt, HeldDir):
        return ckpt / sub
    assert files is not None
    try:
        return files.hold_at(ckpt, sub, why=EXTRA_WHY, hint=EXTRA_HINT)
    except (FileNotFoundError, NotADirectoryError):
        return None


def _trainers(d: Path | HeldDir, name: str, files: HeldFiles | None) -> Path | None:
    """The extra `name` in the trainer's place `d`: None where there is no regular file of that name, a
    SymlinkError where it is a link; held, the file opened from `d` (O_NOFOLLOW), by its proc path."""
    real = d.path / name if isinstance(d, HeldDir) else d / name
    try:
        st = os.stat(name, dir_fd=d.fd, follow_symlinks=False) if isinstance(d, HeldDir) else real.lstat()
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as e:
        raise open_failed(e, real, ExtrasError) from None
    if stat.S_ISLNK(st.st_mode):
        raise linked(real, EXTRA_WHY, EXTRA_HINT)
    if not stat.S_ISREG(st.st_mode):
        return None
    if not isinstance(d, HeldDir):
        return real
    assert files is not None
    try:
        return files.open(d, name, why=EXTRA_WHY, hint=EXTRA_HINT)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise open_failed(e, real, ExtrasError) from None


def read_config(path: Path | None, name: str = "config.json") -> dict[str, Any] | None:
    """The JSON object of the extra `name` found at `path` (a held one's proc path), None for none."""
    if path is None:
        return None
    try:
        return read_json_object(path, label=name)
    except ExtrasError as e:  # the class's hint is a Stager save's: no one saves an adopted step again
        e.hint = f"fix {name}, or pass --extras DIR holding a good one; the trainer's files were not touched"
        raise
