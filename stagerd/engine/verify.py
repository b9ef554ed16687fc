"""Re-read an export and prove it: index and files agree, headers are valid, and (with a source) every
byte equals what the shards give."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from stagerd.contract.safetensors_format import Header, read_header
from stagerd.engine.consolidate import compare, plan
from stagerd.engine.export_map import read_weight_map
from stagerd.engine.merge import lora_merges
from stagerd.engine.source import Source, open_source
from stagerd.errors import StagerdError, VerifyError


@dataclass(frozen=True)
class VerifyReport:
    export_dir: Path
    files: int
    tensors: int
    total_size: int
    compared_with: Path | None


def _check_file(path: Path, h: Header, names: set[str]) -> None:
    if h.data_start % 8:
        raise VerifyError(f"header is not padded to 8 bytes (data starts at {h.data_start})", path=path)
    if h.metadata.get("format") != "pt":
        raise VerifyError('__metadata__ lacks {"format": "pt"}', path=path)
    if set(h.tensors) != names:
        only_file = sorted(set(h.tensors) - names)[:3]
        only_index = sorted(names - set(h.tensors))[:3]
        raise VerifyError(
            f"index and file disagree: only in file {only_file}, only in index {only_index}", path=path
        )
    if sum(t.nbytes for t in h.tensors.values()) != h.file_size - h.data_start:
        raise VerifyError("data section has bytes no tensor accounts for", path=path)


def verify_export(
    export_dir: Path,
    against: Path | None = None,
    *,
    threads: int = 2,
    progress: Callable[[int, int], None] | None = None,
    source: Source | None = None,
) -> VerifyReport:
    """Check the export; with `against` (a step or shard directory) compare every byte with the source.

    `source`: the opened source, where `against` is not a step or shard directory (an adopted checkpoint,
    `engine/adopt/`)."""
    export_dir = Path(export_dir)
    weight_map, total = read_weight_map(export_dir)
    by_file: dict[str, set[str]] = {}
    for name, fname in weight_map.items():
        if not isinstance(fname, str) or "/" in fname or fname.startswith("."):
            raise VerifyError(f"index maps {name!r} to an unsafe file name {fname!r}", path=export_dir)
        by_file.setdefault(fname, set()).add(name)
    file_names = set(by_file)
    # Each export header is checked and reduced to what the comparison needs before the next is read:
    # holding every header's entries at once would cost an object per tensor.
    file_sizes: list[int] = []
    size = 0
    out_dtypes: dict[str, str] = {}
    for fname in sorted(by_file):
        path = export_dir / fname
        try:
            h = read_header(path)
        except StagerdError as e:
            raise VerifyError(f"invalid header: {e.message}", path=path) from None
        _check_file(path, h, by_file.pop(fname))
        file_sizes.append(h.file_size)
        size += h.file_size - h.data_start
        out_dtypes.update((n, t.dtype) for n, t in h.tensors.items())
        del h
    stray = sorted(p.name for p in export_dir.glob("*.safetensors") if p.name not in file_names)
    if stray:
        raise VerifyError(f"safetensors files not in the index: {stray[:3]}", path=export_dir)
    if size != total:
        raise VerifyError(
            f"index says total_size {total}, the files hold {size} tensor bytes", path=export_dir
        )
    if against is not None:
        if source is None:
            source = open_source(Path(against))
        views = source.views()
        with lora_merges(source.scan(), views, source.expected(), None) as (
            merged,
            expected,
        ):  # recomputed, numpy as before
            p = plan(
                itertools.chain(source.scan(), merged),
                reference=weight_map,
                max_shard_size=max(file_sizes) + 1,
                expected=expected,
                out_dtypes=out_dtypes,
                views=views,
            )
            del out_dtypes
            # The plan keeps the reference's grouping and refuses reference keys absent from the shards, so
            # equal counts mean equal tensor sets.
            if {f.name for f in p.files} != file_names or p.tensor_count != len(weight_map):
                raise VerifyError("the source holds different tensors than the export", path=export_dir)
            compare(p, export_dir, threads=threads, progress=progress)
    return VerifyReport(export_dir, len(file_names), len(weight_map), total, against)
