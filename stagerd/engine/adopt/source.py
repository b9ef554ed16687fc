"""A trainer's finished DCP checkpoint as an export source: which preset reads it (`detect.py`), its
metadata, the chosen tensors and their to-Hub plan, and the extras (config, tokenizer) found beside it
(`extras.py`). Whether it is finished, which save it is and an HF checkpoint's files: `finished.py`.

`open_adopted` reads only `.metadata` (through the allowlist reader) and the small JSON extras; the data
files are read by the plan, chunk by chunk. The checkpoint is never written: every path here is opened
read-only, and the export goes to a directory outside it.

Opened through a held checkpoint directory (`export_adopted`), the model's subdirectory is held from it
and each data file opened from that when its header is read (`HeldFiles`, none through a link), then read
again by its own `/proc/self/fd/N`: a `pytorch_model_fsdp_0/` (or a data file) swapped for a link to
another save of the same shapes while it is read, and put back before the check that it held still, led
the reads there. Data files beyond the descriptors the process may hold are closed once checked and opened
again only as the same files (`contract/step/reopen.py`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from stagerd.contract import commit_marker
from stagerd.contract.adopt.dcp_metadata import (
    METADATA_NAME,
    DcpMetadata,
    parse_dcp_metadata,
    read_metadata_bytes,
)
from stagerd.contract.adopt.peft_names import AUTOMODEL_PEFT_CONFIG, refuse_scaled_expert_rank
from stagerd.contract.adopt.presets import (
    ADAPTER_CONFIG,
    AUTO,
    Format,
    Preset,
    resolve_selection,
    select_keys,
)
from stagerd.contract.dtypes import parse_export_dtype
from stagerd.contract.hub_plan import HubPlan
from stagerd.contract.key_mapping import KeyMapping
from stagerd.contract.safetensors_format import Header, read_header
from stagerd.contract.step.held import HeldDir, HeldFiles, reading
from stagerd.engine.adopt.config_shapes import (
    exported,
    refuse_other_rope,
    refuse_other_shapes,
    refuse_oversized,
)
from stagerd.engine.adopt.dcp_headers import DcpFileHeader, dcp_headers
from stagerd.engine.adopt.detect import choose_preset
from stagerd.engine.adopt.extras import find_extras, find_trainers_file, read_config
from stagerd.engine.adopt.finished import data_files, finished, hf_files, save_identity
from stagerd.engine.adopt.model_names import ModelPlan, over_keys
from stagerd.engine.shard_scan import scan_shards, shard_paths
from stagerd.engine.source import Source
from stagerd.errors import AdoptError, DTypeError, ShardError, open_failed

WHY = "an adopted checkpoint is read only from the files its trainer wrote, never through a link"
HINT = "replace the link by the directory or file it stands for (its target was left as it is), then retry"


@dataclass(frozen=True)
class AdoptOptions:
    """How the operator asked for checkpoints to be read (the `--adopt*` settings)."""

    preset: str = AUTO
    select: str | None = None
    mapping: Path | None = None
    extras: Path | None = None
    # the daemon's (or a command's) way to the model's own save names, where config.json names the model
    model_plan: ModelPlan | None = field(default=None, compare=False)


@dataclass(frozen=True)
class AdoptedSource(Source):
    """A FileSystemWriter checkpoint: `model_dir` holds `.metadata` and the `__R_N.distcp` files."""

    preset: Preset
    meta: DcpMetadata | None  # FileSystemWriter; None for HF shards
    keys: tuple[str, ...]
    plan: HubPlan
    extra_files: Mapping[str, Path]
    identity: str  # see `save_identity`
    model: HeldDir | None = None  # `model_dir` held (its proc path), and the files opened from it
    files: HeldFiles | None = None

    @property
    def listed(self) -> list[str] | None:
        return None

    def extras(self) -> list[str]:
        return sorted(self.extra_files)

    def extra_path(self, rel: str) -> Path:
        return self.extra_files[rel]

    def scan(self) -> Iterable[Header]:
        held = self.files is not None
        if self.preset.format is Format.HF_FILES:
            parts = hf_files(self.model_dir, adapter=self.preset.adapter)
            return whole_headers((self._opened(p) for p in parts) if held else parts)
        if self.meta is None:
            if held:
                return (_header(self._opened(p)) for p in shard_paths(self.model_dir))
            return scan_shards(self.model_dir)
        return dcp_headers(self.model_dir, self.meta, self.keys, self._open if held else None)

    def _open(self, name: str) -> Path:
        """The file `name` of the held model directory, opened once, by its proc path (or, beyond the
        descriptors the process may hold, the path `reopen.open_held` opens it by)."""
        assert self.files is not None and self.model is not None
        return self.files.open(self.model, name, why=WHY, hint=HINT, bounded=True)

    def _opened(self, path: Path) -> Path:
        try:
            return self._open(path.name)
        except OSError as e:
            raise open_failed(e, path, ShardError) from None

    def expected(self) -> Mapping[str, commit_marker.TensorInfo] | None:
        if self.meta is None:
            return None  # HF shards record no global shapes
        t = self.meta.tensors
        return {k: commit_marker.TensorInfo(t[k].dtype, t[k].shape) for k in self.keys}

    def views(self) -> HubPlan:
        return self.plan

    def target_dtype(self, override: str | None) -> str | None:
        return parse_export_dtype(override)

    def reference(self) -> dict[str, str] | None:
        return None

    def read_files(self) -> list[Path]:
        """Every file the export reads: `.metadata`, the data files of the chosen tensors, the extras."""
        extras = [self.extra_files[r] for r in sorted(self.extra_files)]
        if self.meta is None:
            return [*data_files(self.model_dir, self.preset), *extras]
        data = {c.file for k in self.keys for c in self.meta.tensors[k].chunks}
        return [self.model_dir / METADATA_NAME, *(self.model_dir / f for f in sorted(data)), *extras]


def whole_headers(files: Iterable[Path]) -> Iterator[Header]:
    """Each HF file's header, every tensor a whole block (offsets 0), read one at a time."""
    for f in files:
        h = _header(f)
        offsets = {n: (0,) * len(e.shape) for n, e in h.tensors.items()}
        yield DcpFileHeader(h.path, h.file_size, h.data_start, h.tensors, h.metadata, offsets=offsets)


def _header(path: Path) -> Header:
    """`read_header`, of a file closed for want of descriptors too (opened again, the same file)."""
    try:
        with reading(path) as now:
            h = read_header(now)
    except OSError as e:
        raise open_failed(e, e.filename or path, ShardError) from None
    return h if now == path else replace(h, path=str(path))


def open_adopted(
    ckpt: Path,
    options: AdoptOptions | None = None,
    *,
    parent: Path | HeldDir | None = None,
    held: tuple[HeldDir, HeldFiles] | None = None,
    dtype: str | None = None,
) -> AdoptedSource:
    """Open a finished checkpoint for export; an unfinished one is an AdoptError, and nothing is read.
    `parent`: the directory the checkpoint is in (where extras may be; held, its extras are read through
    it), when `ckpt` is a held one's proc path; `held`: that directory, and where the model's directory,
    data files and extras are held (see the module). `dtype`: the export's (`--dtype`), only to say where
    a cast cannot leave what the model keeps in float32; the plan is the same for every dtype."""
    ckpt, options = Path(ckpt), options or AdoptOptions()
    preset = choose_preset(ckpt, options.preset, None if held is None else held[0].path.name)
    model_dir = ckpt / preset.model_dir if preset.model_dir != "." else ckpt
    if finished(ckpt, preset) is None:
        raise AdoptError(
            f"not finished: no {', '.join(preset.completion_files()) or 'shards'} yet"
            f"{f' or {preset.incomplete} still there' if preset.incomplete else ''} (preset {preset.name})",
            path=ckpt,
            hint="stagerd exports a checkpoint only once its trainer has finished writing it",
        )
    model = None
    if held is not None:
        model, files = held
        if preset.model_dir != ".":
            model = files.hold_at(model, preset.model_dir, why=WHY, hint=HINT)
        model_dir = model.proc
    meta = None
    if preset.format is Format.DCP:
        raw = read_metadata_bytes(model_dir / METADATA_NAME)
        meta = parse_dcp_metadata(raw, model_dir / METADATA_NAME)
        ident = "dcp:" + hashlib.sha256(raw).hexdigest()
        shapes = {k: t.shape for k, t in meta.tensors.items()}
    elif preset.format is Format.HF_FILES:
        ident = save_identity(ckpt, preset)
        parts = hf_files(model_dir, adapter=preset.adapter)
        shapes = {n: e.shape for h in whole_headers(parts) for n, e in h.tensors.items()}
    else:
        ident = save_identity(ckpt, preset)
        shapes = shard_shapes(model_dir)
    where = ckpt.parent if parent is None else parent
    if held is None:
        extras = find_extras(ckpt, preset, options.extras, where)
    else:
        extras = find_extras(held[0], preset, options.extras, where, held[1])
    if preset.adapter and ADAPTER_CONFIG not in extras:
        raise AdoptError(
            f"a PEFT adapter without its {ADAPTER_CONFIG}: PeftModel.from_pretrained could not load it",
            path=ckpt,
            hint=f"save it with PeftModel.save_pretrained, or pass --extras DIR holding its {ADAPTER_CONFIG}",
        )
    config = read_config(extras.get("config.json"))
    if config is not None and options.model_plan is not None and not preset.adapter:
        refuse_oversized(config, shapes)  # before the planners build its model
    mapping = KeyMapping.load(options.mapping) if options.mapping is not None else None
    model_names = _model_named(preset, meta, options, config)
    if model_names is None:
        keys, plan = resolve_selection(preset, shapes, select=options.select, mapping=mapping, config=config)
    else:
        keys, plan = model_names
    if preset.adapter:
        at = ckpt if held is None else held[0]
        automodel = find_trainers_file(at, preset, AUTOMODEL_PEFT_CONFIG, None if held is None else held[1])
        adapter_config = read_config(extras[ADAPTER_CONFIG], ADAPTER_CONFIG) or {}

        def base_config() -> Mapping[str, object] | None:  # the base model's: only its experts per token
            files = None if held is None else held[1]
            found = find_extras(at, preset, options.extras, where, files, ("config.json",))
            return read_config(found.get("config.json"))

        views = [v.name for v in plan.views]
        refuse_scaled_expert_rank(
            read_config(automodel, AUTOMODEL_PEFT_CONFIG), adapter_config, views, base_config
        )
    if meta is None:  # every tensor of the shards is planned: the ones not chosen are dropped by name
        plan = replace(plan, drop=tuple(sorted(set(shapes) - set(keys))))
    elif model_names is None:  # save_pretrained fills its files in its state dict's order, as `.metadata`
        place = {k: i for i, k in enumerate(meta.tensors)}
        plan = replace(plan, order=tuple(v.name for v in sorted(plan.views, key=lambda v: place[v.source])))
    if model_names is None and not preset.adapter:
        _config_shapes(plan, options, config)
        plan = _kept_fp32(plan, options, config, dtype)
    return AdoptedSource(
        model_dir,
        None,
        ckpt,
        preset=preset,
        meta=meta,
        keys=tuple(keys),
        plan=plan,
        extra_files=extras,
        identity=ident,
        model=model,
        files=None if held is None else held[1],
    )


def _model_named(
    preset: Preset, meta: DcpMetadata | None, options: AdoptOptions, config: Mapping[str, object] | None
) -> tuple[list[str], HubPlan] | None:
    """The keys and plan that give the names, layout and order `save_pretrained` writes, where
    config.json names the model whose live names the selected tensors have (`model_names.py`); else None.
    An operator's --mapping decides the names itself, and a PEFT adapter keeps PEFT's; HF files and shards
    hold the names their writer chose for the Hub already. A trainer whose names are its own (a preset with
    a key mapping: torchtitan's) has them planned by its own conversion where it has one for the model,
    else by its preset's mapping."""
    if options.model_plan is None or config is None or meta is None:
        return None
    if preset.adapter or options.mapping is not None:
        return None
    chosen = select_keys(preset, list(meta.tensors), options.select)
    t = meta.tensors
    trainer = preset.name if preset.mapping is not None else None
    model = options.model_plan({n: (t[k].shape, t[k].dtype) for n, k in chosen.items()}, config, trainer)
    return None if model is None else over_keys(model, chosen, {k: t[k].shape for k in chosen.values()})


def _kept_fp32(
    plan: HubPlan, options: AdoptOptions, config: Mapping[str, object] | None, dtype: str | None
) -> HubPlan:
    """`plan`, whose names are kept as the checkpoint has them (every output a view), with what the model
    config.json names keeps in float32 under a cast: a cast export is then `save_pretrained` of the model
    `from_pretrained` loads in that dtype, as where its names are planned. PEFT's adapter loads as saved."""
    if options.model_plan is None or config is None or plan.uncast:
        return plan
    names = list(dict.fromkeys(v.name for v in plan.views))
    try:
        casting = parse_export_dtype(dtype) in ("BF16", "F16")
    except DTypeError:  # named by the export itself
        casting = False
    return replace(plan, uncast=options.model_plan.uncast(names, config, casting=casting))


def _config_shapes(plan: HubPlan, options: AdoptOptions, config: Mapping[str, object] | None) -> None:
    """A ModelShapeError where `plan` (names kept or mapped) exports a tensor of another shape than the
    model config.json names has under that name, or puts RoPE rows in order in other heads than it rotates
    (`config_shapes.py`): `from_pretrained` of the export would build that model. Its model is the one
    built for `_kept_fp32`, once."""
    if options.model_plan is None or config is None:
        return
    want = options.model_plan.shapes(config)
    if want is not None:
        refuse_other_shapes(exported(plan), want)
        refuse_other_rope(plan, want, mapping=options.mapping is not None)


def shard_shapes(model_dir: Path) -> dict[str, tuple[int, ...]]:
    """The global shape of every tensor in HF shards: `max(offset + local shape)` per dim (the tiling
    check in `plan()` proves it later)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for h in scan_shards(model_dir):
        for name, offs in h.dcp_offsets().items():
            ext = tuple(o + n for o, n in zip(offs, h.tensors[name].shape, strict=True))
            old = shapes.get(name, ext)
            shapes[name] = (
                tuple(max(a, b) for a, b in zip(old, ext, strict=False)) if len(old) == len(ext) else ext
            )
    return shapes
