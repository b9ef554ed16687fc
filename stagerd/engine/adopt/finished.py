"""Whether a trainer's checkpoint is finished, and which save it is, from its files alone, before it is
opened: what the daemon asks of each checkpoint on every scan. And which safetensors files an HF
checkpoint is made of (its index's, else `model.safetensors`; a PEFT adapter's one file), which both
read and `source.py` opens."""

from __future__ import annotations

import hashlib
import json
import re
import zipfile
from pathlib import Path

from stagerd.contract import layout
from stagerd.contract.adopt.dcp_metadata import read_metadata_bytes
from stagerd.contract.adopt.presets import Format, Preset
from stagerd.contract.layout import ADAPTER_WEIGHTS_NAME
from stagerd.contract.pickle_depth import show
from stagerd.contract.reference_index import MAX_INDEX_BYTES, read_reference_index
from stagerd.contract.regular_file import open_regular, read_bounded
from stagerd.contract.safetensors_format import read_header
from stagerd.engine.parsed_extras import MAX_PARSED_EXTRA_BYTES
from stagerd.engine.shard_scan import shard_paths
from stagerd.errors import ShardError, StagerdError

_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def finished(ckpt: Path, preset: Preset) -> float | None:
    """When a checkpoint was finished (its newest completion file's mtime), or None while it is not:
    a completion file missing, the preset's `incomplete` file present, a zip completion file whose
    directory cannot be read yet, a JSON one (written in place) that does not parse yet."""
    try:
        times = [(ckpt / f).stat().st_mtime for f in preset.completion_files()]
        if preset.incomplete is not None:
            if (ckpt / preset.incomplete).exists():
                return None
            times.append(ckpt.stat().st_mtime)  # the removal of `incomplete` touched it
        if preset.format is Format.HF_SHARDS and not shard_paths(ckpt / preset.model_dir):
            return None
        if preset.format is Format.HF_FILES:  # whole: the index parses, every header fits its file
            for part in _finished_files(ckpt / preset.model_dir, preset.adapter):
                if part.name != layout.INDEX_NAME:
                    read_header(part)
                times.append(part.stat().st_mtime)
        # A FIFO in a completion file's place would hold the scan for good, and JSON nested too deep
        # raises RecursionError: each is a checkpoint that is not finished, never a stuck or dead daemon.
        if not all(_zip_reads(ckpt / z) for z in preset.zips):
            return None
        for j in preset.jsons:
            with open_regular(ckpt / j) as f:
                json.loads(read_bounded(f, MAX_PARSED_EXTRA_BYTES))
    except (OSError, ValueError, RecursionError, zipfile.BadZipFile, StagerdError):
        return None
    return max(times) if times else None


def _zip_reads(path: Path) -> bool:
    """Whether the zip archive `path` (a regular file) has a directory that reads: one being written has
    none yet."""
    try:
        with open_regular(path) as f, zipfile.ZipFile(f):
            return True
    # Not only BadZipFile: a directory naming a zip version past zipfile's (NotImplementedError), an offset
    # past what a seek takes, each raise their own kind. A damaged archive is one not finished, whatever
    # zipfile calls it, never an exception out of the daemon's scan.
    except Exception:
        return False


def save_identity(ckpt: Path, preset: Preset) -> str:
    """Which save a finished checkpoint is: `dcp:` + the sha256 of `.metadata` (a new save has a new
    save_id in it); for HF shards and files, `files:` + the sha256 of their names, sizes and mtimes."""
    if preset.format is Format.DCP:
        return "dcp:" + hashlib.sha256(read_metadata_bytes(ckpt / preset.metadata_file())).hexdigest()
    h = hashlib.sha256()
    for p in data_files(ckpt / preset.model_dir, preset):
        st = p.stat()
        h.update(f"{p.name}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return "files:" + h.hexdigest()


def data_files(model_dir: Path, preset: Preset) -> list[Path]:
    """The safetensors files of an HF-shards or HF-files checkpoint (with the index, for HF files)."""
    if preset.format is Format.HF_FILES:
        index = model_dir / layout.INDEX_NAME
        if preset.adapter:
            return hf_files(model_dir, adapter=True)
        listed = _finished_files(model_dir, False)
        return listed if listed[-1:] == [index] else [*listed, *([index] if index.is_file() else [])]
    return shard_paths(model_dir)


def _finished_files(model_dir: Path, adapter: bool) -> list[Path]:
    """`hf_files`, or the index alone where it is whole JSON that `hf_files` refuses (a NUL or a path in a
    file name, no weight_map): written out, so final. Such a checkpoint is finished, and its export names
    the defect and is quarantined; waited on, it would be neither published nor named, for good."""
    try:
        return hf_files(model_dir, adapter=adapter)
    except StagerdError:
        index = model_dir / layout.INDEX_NAME
        if adapter or not _whole_json(index):
            raise
        return [index]


def _whole_json(path: Path) -> bool:
    """Whether `path` is a regular file of JSON that parses: an index still being written never does."""
    try:
        with open_regular(path) as f:
            json.loads(read_bounded(f, MAX_INDEX_BYTES + 1))
    except (OSError, ValueError, RecursionError, StagerdError):
        return False
    return True


def hf_files(model_dir: Path, *, adapter: bool = False) -> list[Path]:
    """The files of an HF checkpoint: those its index names, else `model.safetensors` alone; of a PEFT
    adapter, its one `adapter_model.safetensors` (PEFT writes no index)."""
    if adapter:
        if not (model_dir / ADAPTER_WEIGHTS_NAME).is_file():
            raise ShardError(f"no {ADAPTER_WEIGHTS_NAME}", path=model_dir)
        return [model_dir / ADAPTER_WEIGHTS_NAME]
    index = model_dir / layout.INDEX_NAME
    if index.is_file():
        names = sorted(set(read_reference_index(index).values()))
        for n in names:  # a NUL would reach os.open as a bare ValueError; `..` or `/x` another directory
            if "/" in n or n.startswith(".") or _CONTROL.search(n):
                raise ShardError(
                    f"the index names the file {show(n)}, which is not a plain name in its directory",
                    path=index,
                    hint="the index is not one a trainer wrote: re-save the checkpoint; nothing of it was "
                    "exported or published, and the trainer's files were not touched",
                )
        return [model_dir / n for n in names]
    single = model_dir / layout.WEIGHTS_NAME
    if not single.is_file():
        raise ShardError("no model.safetensors or model.safetensors.index.json", path=model_dir)
    return [single]
