"""Which preset reads a checkpoint: the one named, or with `auto` the first whose layout the checkpoint has,
judged by its directory's name, its paths and `.metadata`'s keys (never by its completion files)."""

from __future__ import annotations

import re
from pathlib import Path

from stagerd.contract.adopt.dcp_metadata import read_dcp_metadata
from stagerd.contract.adopt.presets import AUTO, AUTO_ORDER, LAYOUTS, Format, Preset, get_preset
from stagerd.errors import AdoptError, DcpFormatError


def choose_preset(ckpt: Path, name: str, dir_name: str | None = None) -> Preset:
    """The named preset (of its layouts, the first this checkpoint fits as auto judges it, else the first
    whose paths it has that names no key), or with `auto` the first of AUTO_ORDER whose layout this
    checkpoint has (judged by its name and paths, and by `.metadata`'s keys where the preset names a key;
    never by its completion files). `dir_name`: the checkpoint directory's name, where `ckpt` is a held
    one's proc path."""
    keys: dict[Path, set[str] | None] = {}  # each `.metadata` read once, whichever presets look at it
    if name != AUTO:
        layouts = LAYOUTS[get_preset(name).name]
        fit = next((p for p in layouts if _fits(ckpt, p, keys, dir_name)), None)
        plain = (p for p in layouts if p.detect_key is None and _has_paths(ckpt, p))
        return fit or next(plain, layouts[0])
    for p in (p for candidate in AUTO_ORDER for p in LAYOUTS[candidate]):
        if _fits(ckpt, p, keys, dir_name):
            return p
    raise AdoptError(f"no preset recognises {ckpt} (no DCP .metadata where a trainer writes it)", path=ckpt)


def fitting_layout(ckpt: Path, name: str) -> Preset | None:
    """The layout of preset `name` (with `auto`, of any) this directory has as a checkpoint, judged as
    `choose_preset`'s auto judges one (name, paths, `.metadata`'s keys); None where it has none of them."""
    keys: dict[Path, set[str] | None] = {}
    names = AUTO_ORDER if name == AUTO else (get_preset(name).name,)
    return next((p for n in names for p in LAYOUTS[n] if _fits(ckpt, p, keys, None)), None)


def _fits(ckpt: Path, p: Preset, keys: dict[Path, set[str] | None], dir_name: str | None) -> bool:
    if p.detect_name is not None and re.fullmatch(p.detect_name, dir_name or ckpt.name) is None:
        return False
    if not _has_paths(ckpt, p):
        return False
    if p.format is Format.DCP:
        meta = ckpt / p.metadata_file()
        if not meta.is_file():
            return False
        if p.detect_key is not None:
            if meta not in keys:
                try:
                    keys[meta] = set(read_dcp_metadata(meta).tensors)
                except DcpFormatError:
                    keys[meta] = None  # the generic preset takes it, and its export names the defect
            rx = re.compile(p.detect_key)
            if not any(rx.fullmatch(k) for k in keys[meta] or ()):
                return False
    return True


def _has_paths(ckpt: Path, p: Preset) -> bool:
    if p.detect_paths and not any((ckpt / d).exists() for d in p.detect_paths):
        return False
    return all((ckpt / d).exists() for d in p.detect_also)
