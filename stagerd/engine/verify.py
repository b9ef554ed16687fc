"""Re-read an export and prove it: index and files agree, headers are valid, and (with a source) every
byte equals what the shards give."""

from __future__ import annotations

import dataclasses
import itertools
from array import array
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from stagerd.contract import dtypes
from stagerd.contract.header_entries import TensorEntry
from stagerd.contract.safetensors_format import HeaderStream
from stagerd.engine.consolidate import compare, plan
from stagerd.engine.export_map import one_file, read_index
from stagerd.engine.file_header import header_size
from stagerd.engine.merge import lora_merges
from stagerd.engine.plan_types import DTYPE_NAMES, ExportPlan, OutputFile, frozen
from stagerd.engine.source import Source, open_source
from stagerd.errors import StagerdError, VerifyError


@dataclass(frozen=True)
class VerifyReport:
    """`older_order`: the files whose tensors lie in another order than safetensors' writer order (the
    one save_pretrained writes), as a stagerd before that order wrote them: their bytes are right."""

    export_dir: Path
    files: int
    tensors: int
    total_size: int
    compared_with: Path | None
    older_order: tuple[str, ...] = ()


def _entries(path: Path) -> tuple[HeaderStream, Iterator[TensorEntry]]:
    """The file's header, streamed entry by entry (no object per tensor is held), its errors named as
    verify's."""
    try:
        s = HeaderStream(path)
    except StagerdError as e:
        raise VerifyError(f"invalid header: {e.message}", path=path) from None

    def each() -> Iterator[TensorEntry]:
        it = s.entries()
        while True:
            try:
                t = next(it)
            except StopIteration:
                return
            except StagerdError as e:
                raise VerifyError(f"invalid header: {e.message}", path=path) from None
            yield t

    return s, each()


def _check_file(
    path: Path, names: set[str] | None, weight_map: dict[str, str], out_dtypes: dict[str, str] | None
) -> tuple[int, int, bool]:
    """Check one export file against the index, its header read one entry at a time; `names` (the
    index's names for it) is emptied; with no index (`names` None), `weight_map` is filled from the
    header instead. (file size, data bytes, whether its layout is an older stagerd's)."""
    s, entries = _entries(path)
    if s.data_start % 8:
        raise VerifyError(f"header is not padded to 8 bytes (data starts at {s.data_start})", path=path)
    pos = total = 0  # in data order so far: each entry starts where the one before ends
    in_data_order = writer_order = True
    last: tuple[int, str] | None = None
    fname = path.name
    for t in entries:
        if names is None:  # the one file of an export without an index: the header is the list
            if t.name in weight_map:
                raise VerifyError(f"the header names {t.name!r} twice", path=path)
            weight_map[t.name] = fname
        else:
            try:
                names.remove(t.name)
            except KeyError:
                twice = weight_map.get(t.name) == fname
                raise VerifyError(
                    f"the header names {t.name!r} twice"
                    if twice
                    else f"index and file disagree: only in file [{t.name!r}]",
                    path=path,
                ) from None
        in_data_order = in_data_order and t.begin == pos
        pos = t.end
        total += t.nbytes
        key = (-dtypes.writer_rank(t.dtype), t.name)
        writer_order = writer_order and (last is None or last <= key)
        last = key
        if out_dtypes is not None:
            out_dtypes[t.name] = t.dtype
    if s.metadata.get("format") != "pt":
        raise VerifyError('__metadata__ lacks {"format": "pt"}', path=path)
    if names:
        raise VerifyError(f"index and file disagree: only in index {sorted(names)[:3]}", path=path)
    if total != s.file_size - s.data_start:
        raise VerifyError("data section has bytes no tensor accounts for", path=path)
    return s.file_size, s.file_size - s.data_start, in_data_order and not writer_order


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
    # Each export header is streamed and reduced to what the comparison needs: holding a header's entries
    # (or its decoded JSON) at once would cost objects per tensor.
    out_dtypes: dict[str, str] | None = {} if against is not None else None
    checked: list[tuple[str, int, int, bool]] = []  # file name, file size, data bytes, older order
    listed = read_index(export_dir)
    if listed is None:  # one model.safetensors: its names come from the same streamed read that checks it
        path = one_file(export_dir)
        weight_map: dict[str, str] = {}
        checked.append((path.name, *_check_file(path, None, weight_map, out_dtypes)))
        total = checked[0][2]
    else:
        weight_map, total = listed
        by_file: dict[str, set[str]] = {}
        for name, fname in weight_map.items():
            # a NUL reached os.open as a raw ValueError; "" named the export directory itself
            if not isinstance(fname, str) or not fname or "/" in fname or "\x00" in fname or fname[0] == ".":
                raise VerifyError(f"index maps {name!r} to an unsafe file name {fname!r}", path=export_dir)
            by_file.setdefault(fname, set()).add(name)
        for fname in sorted(by_file):
            checked.append(
                (fname, *_check_file(export_dir / fname, by_file.pop(fname), weight_map, out_dtypes))
            )
    file_names = {c[0] for c in checked}
    file_sizes = [c[1] for c in checked]
    size = sum(c[2] for c in checked)
    older = [c[0] for c in checked if c[3]]
    stray = sorted(p.name for p in export_dir.glob("*.safetensors") if p.name not in file_names)
    if stray:
        raise VerifyError(f"safetensors files not in the index: {stray[:3]}", path=export_dir)
    # save_pretrained's total_size counts a storage its tensors share once, by all its bytes (a flat
    # buffer's tied pair): never less than the files hold; with the source, what its plan gives
    if size > total:
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
            if listed is None and len(p.files) == 1 and p.files[0].name != checked[0][0]:
                # an adopted PEFT adapter's one file is PEFT's `adapter_model.safetensors`
                p = dataclasses.replace(p, files=(dataclasses.replace(p.files[0], name=checked[0][0]),))
            # The plan keeps the reference's grouping and refuses reference keys absent from the shards, so
            # equal counts mean equal tensor sets.
            if {f.name for f in p.files} != file_names or p.tensor_count != len(weight_map):
                raise VerifyError("the source holds different tensors than the export", path=export_dir)
            if total not in (p.total_size, size):  # size: a stagerd before storages were counted
                raise VerifyError(
                    f"index says total_size {total}, the source gives {p.total_size}", path=export_dir
                )
            if older:
                p = _relaid(p, export_dir, set(older))
            compare(p, export_dir, threads=threads, progress=progress)
    return VerifyReport(export_dir, len(file_names), len(weight_map), total, against, tuple(older))


def _relaid(p: ExportPlan, export_dir: Path, older: set[str]) -> ExportPlan:
    """`p` with the tensors of the files in `older` laid out as the export's files lay them (an older
    stagerd's order), so that `compare` checks the header and every byte where they really are. Any
    other difference from the source (a dtype, a shape) is named here."""
    tensor, dst, begin, end = array("i"), array("B"), array("q"), array("q")
    files: list[OutputFile] = []
    for f in p.files:
        first = len(tensor)
        if f.name not in older:
            for r in range(f.first, f.stop):
                tensor.append(p.tensor[r])
                dst.append(p.dst_dtype[r])
                begin.append(p.begin[r])
                end.append(p.end[r])
            files.append(OutputFile(f.name, f.header_size, f.size, first, len(tensor)))
            continue
        rows = {p.chunks.names[p.tensor[r]]: r for r in range(f.first, f.stop)}
        path = export_dir / f.name
        for t in _entries(path)[1]:
            r = rows.pop(t.name, -1)
            if r < 0:
                raise VerifyError(f"tensor {t.name!r} is not one the source puts in this file", path=path)
            want = (DTYPE_NAMES[p.dst_dtype[r]], p.shape(p.tensor[r]))
            if (t.dtype, t.shape) != want:
                raise VerifyError(
                    f"tensor {t.name!r} is {t.dtype} of shape {list(t.shape)}, the source gives"
                    f" {want[0]} of shape {list(want[1])}",
                    path=path,
                )
            tensor.append(p.tensor[r])
            dst.append(p.dst_dtype[r])
            begin.append(t.begin)
            end.append(t.end)
        if rows:
            raise VerifyError(
                f"tensors the source puts in this file are missing: {sorted(rows)[:3]}", path=path
            )
        entries = (
            (p.chunks.names[tensor[r]], DTYPE_NAMES[dst[r]], p.shape(tensor[r]), begin[r], end[r])
            for r in range(first, len(tensor))
        )
        size = header_size(entries)
        files.append(OutputFile(f.name, size, size + f.data_size, first, len(tensor)))
    return dataclasses.replace(
        p,
        files=tuple(files),
        tensor=frozen(tensor),
        dst_dtype=frozen(dst),
        begin=frozen(begin),
        end=frozen(end),
    )
