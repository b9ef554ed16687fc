"""A trainer's finished DCP checkpoint as an export source: which preset reads it, its metadata, the
chosen tensors and their to-Hub plan, and the extras (config, tokenizer) found beside it.

`open_adopted` reads only `.metadata` (through the allowlist reader) and the small JSON extras; the data
files are read by the plan, chunk by chunk. The checkpoint is never written: every path here is opened
read-only, and the export goes to a directory outside it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stagerd.contract import layout
from stagerd.contract.adopt.dcp_metadata import (
    METADATA_NAME,
    DcpMetadata,
    parse_dcp_metadata,
    read_dcp_metadata,
    read_metadata_bytes,
)
from stagerd.contract.adopt.presets import (
    AUTO,
    AUTO_ORDER,
    PRESETS,
    Preset,
    get_preset,
    resolve_selection,
)
from stagerd.contract.dtypes import parse_export_dtype
from stagerd.contract.hub_plan import HubPlan
from stagerd.contract.key_mapping import KeyMapping
from stagerd.contract.safetensors_format import Header
from stagerd.engine.adopt.dcp_headers import dcp_headers
from stagerd.engine.export import MAX_PARSED_EXTRA_BYTES, Source
from stagerd.errors import AdoptError, ExtrasError

# What from_pretrained and tokenizers read beside the weights; copied into the export where found.
HF_EXTRAS = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "spiece.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "preprocessor_config.json",
    "processor_config.json",
)


@dataclass(frozen=True)
class AdoptOptions:
    """How the operator asked for checkpoints to be read (the `--adopt*` settings)."""

    preset: str = AUTO
    select: str | None = None
    mapping: Path | None = None
    extras: Path | None = None


@dataclass(frozen=True)
class AdoptedSource(Source):
    """A FileSystemWriter checkpoint: `model_dir` holds `.metadata` and the `__R_N.distcp` files."""

    preset: Preset = field(default_factory=lambda: PRESETS["dcp"])
    meta: DcpMetadata = field(default_factory=lambda: DcpMetadata({}, (), ()))
    keys: tuple[str, ...] = ()
    plan: HubPlan = field(default_factory=HubPlan)
    extra_files: Mapping[str, Path] = field(default_factory=dict)
    identity: str = ""  # `dcp:` + sha256 of `.metadata`

    @property
    def listed(self) -> list[str] | None:
        return None

    def extras(self) -> list[str]:
        return sorted(self.extra_files)

    def extra_path(self, rel: str) -> Path:
        return self.extra_files[rel]

    def scan(self) -> Iterable[Header]:
        return dcp_headers(self.model_dir, self.meta, self.keys)

    def expected(self) -> Mapping[str, layout.TensorInfo]:
        t = self.meta.tensors
        return {k: layout.TensorInfo(t[k].dtype, t[k].shape) for k in self.keys}

    def views(self) -> HubPlan:
        return self.plan

    def target_dtype(self, override: str | None) -> str | None:
        return parse_export_dtype(override)

    def reference(self) -> dict[str, str] | None:
        return None

    def read_files(self) -> list[Path]:
        """Every file the export reads: `.metadata`, the data files of the chosen tensors, the extras."""
        data = {c.file for k in self.keys for c in self.meta.tensors[k].chunks}
        return [self.model_dir / METADATA_NAME, *(self.model_dir / f for f in sorted(data))] + [
            self.extra_files[r] for r in sorted(self.extra_files)
        ]


def choose_preset(ckpt: Path, name: str) -> Preset:
    """The named preset, or with `auto` the first of AUTO_ORDER whose layout this checkpoint has."""
    if name != AUTO:
        return get_preset(name)
    for candidate in AUTO_ORDER:
        p = PRESETS[candidate]
        meta = ckpt / p.completion_files()[0]
        if not meta.is_file():
            continue
        if p.detect_key is not None:
            import re

            rx = re.compile(p.detect_key)
            if not any(rx.fullmatch(k) for k in read_dcp_metadata(meta).tensors):
                continue
        return p
    raise AdoptError(f"no preset recognises {ckpt} (no DCP .metadata where a trainer writes it)", path=ckpt)


def find_extras(ckpt: Path, extras_dir: Path | None) -> dict[str, Path]:
    """Each HF extra from the first place that has it: the checkpoint, --extras DIR, the parent."""
    places = [ckpt, *([extras_dir] if extras_dir is not None else []), ckpt.parent]
    found: dict[str, Path] = {}
    for name in HF_EXTRAS:
        for d in places:
            if (d / name).is_file():
                found[name] = d / name
                break
    return found


def read_config(path: Path | None) -> dict[str, Any] | None:
    if path is None:
        return None
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_PARSED_EXTRA_BYTES + 1)
        config = json.loads(raw) if len(raw) <= MAX_PARSED_EXTRA_BYTES else None
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise ExtrasError(f"config.json is unreadable: {e}", path=path) from None
    if not isinstance(config, dict):
        raise ExtrasError("config.json must hold one JSON object of at most 16 MiB", path=path)
    return config


def open_adopted(ckpt: Path, options: AdoptOptions | None = None) -> AdoptedSource:
    """Open a finished checkpoint for export; an unfinished one is an AdoptError, and nothing is read."""
    ckpt, options = Path(ckpt), options or AdoptOptions()
    preset = choose_preset(ckpt, options.preset)
    model_dir = ckpt / preset.model_dir if preset.model_dir != "." else ckpt
    missing = [f for f in preset.completion_files() if not (ckpt / f).is_file()]
    if missing:
        raise AdoptError(
            f"not finished: {', '.join(missing)} missing (preset {preset.name})",
            path=ckpt,
            hint="stagerd exports a checkpoint only once its trainer has finished writing it",
        )
    meta_path = model_dir / METADATA_NAME
    raw = read_metadata_bytes(meta_path)
    meta = parse_dcp_metadata(raw, meta_path)
    extras = find_extras(ckpt, options.extras)
    config = read_config(extras.get("config.json"))
    mapping = KeyMapping.load(options.mapping) if options.mapping is not None else None
    shapes = {k: t.shape for k, t in meta.tensors.items()}
    keys, plan = resolve_selection(preset, shapes, select=options.select, mapping=mapping, config=config)
    return AdoptedSource(
        model_dir,
        None,
        ckpt,
        preset=preset,
        meta=meta,
        keys=tuple(keys),
        plan=plan,
        extra_files=extras,
        identity="dcp:" + hashlib.sha256(raw).hexdigest(),
    )
