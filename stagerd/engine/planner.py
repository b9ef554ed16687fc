"""`plan()`: validated shard headers in, a frozen `ExportPlan` out. Pure: reads nothing, writes nothing."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

from stagerd.contract import dtypes
from stagerd.contract.layout import TensorInfo
from stagerd.contract.safetensors_format import Header, encode_header
from stagerd.contract.sharding import (
    DEFAULT_MAX_SHARD_SIZE,
    assign_with_reference,
    natural_key,
    output_file_names,
    pack_by_size,
)
from stagerd.engine.moves import split_and_merge, tensor_moves
from stagerd.engine.plan_types import Chunk, ExportPlan, Move, OutputFile, TensorPlan
from stagerd.engine.tiling import check_tiling
from stagerd.errors import DTypeError, PlanError


def plan(
    headers: Sequence[Header],
    *,
    dtype: str | None = None,
    keep_dtype: str | None = None,
    reference: Mapping[str, str] | None = None,
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
    expected: Mapping[str, TensorInfo] | None = None,
    out_dtypes: Mapping[str, str] | None = None,
) -> ExportPlan:
    """Turn validated shard headers into a frozen export plan. Pure: reads nothing, writes nothing.

    `dtype` is a safetensors name (`BF16`) or None to keep; `keep_dtype` a regex of names never cast;
    `reference` a weight_map whose grouping to keep; `expected` the global dtype and shape of every tensor
    as the trainer saw it (from the commit marker), which catches a missing trailing shard; `out_dtypes`
    pins the output dtype of named tensors (verify uses it to re-derive an existing export).
    """
    if dtype is not None:
        dt = dtypes.lookup(dtype)
        if not dt.castable:
            raise DTypeError(f"cannot export as {dtype}: only F32, F16, BF16 and F64 are cast targets")
    keep = _compile(keep_dtype)
    where = str(Path(headers[0].path).parent) if headers else "."
    found: dict[str, list[Chunk]] = {}
    src_dtype: dict[str, str] = {}
    for i, h in enumerate(headers):
        offsets = h.dcp_offsets()
        for name, e in h.tensors.items():
            if src_dtype.setdefault(name, e.dtype) != e.dtype:
                raise PlanError(
                    f"tensor {name!r} is {src_dtype[name]} in one shard and {e.dtype} in {h.path}", path=where
                )
            found.setdefault(name, []).append(Chunk(i, h.data_start + e.begin, offsets[name], e.shape))

    shapes: dict[str, tuple[int, ...]] = {}
    for name, chunks in found.items():
        ndims = {len(c.shape) for c in chunks}
        if len(ndims) != 1:
            raise PlanError(f"tensor {name!r} has chunks of different ranks {sorted(ndims)}", path=where)
        nd = ndims.pop()
        shapes[name] = tuple(max(c.global_offset[d] + c.shape[d] for c in chunks) for d in range(nd))
    if expected is not None:
        _check_expected(shapes, src_dtype, expected, where)
    for name, chunks in found.items():
        check_tiling(name, shapes[name], chunks, where)

    out_dtype = {n: _out_dtype(n, src_dtype[n], dtype, keep) for n in found}
    for n, dt_name in (out_dtypes or {}).items():
        if n in out_dtype and dt_name != src_dtype[n]:
            if not (dtypes.lookup(src_dtype[n]).castable and dtypes.lookup(dt_name).castable):
                raise DTypeError(f"tensor {n!r}: {src_dtype[n]} cannot become {dt_name}", path=where)
            out_dtype[n] = dt_name
        elif n in out_dtype:
            out_dtype[n] = dt_name
    sizes = {n: dtypes.lookup(out_dtype[n]).nbytes(math.prod(shapes[n])) for n in found}
    groups = (
        assign_with_reference(sizes, reference, max_shard_size)
        if reference is not None
        else pack_by_size(sizes, max_shard_size)
    )
    names = output_file_names(len(groups))
    tensors: list[TensorPlan] = []
    files: list[OutputFile] = []
    moves: list[Move] = []
    for fi, group in enumerate(groups):
        # Widest dtypes first: with an 8-aligned data section every tensor stays aligned for mmap readers.
        order = sorted(group, key=lambda n: (-dtypes.lookup(out_dtype[n]).bits, natural_key(n)))
        entries: dict[str, tuple[str, tuple[int, ...], int, int]] = {}
        pos = 0
        planned = []
        for n in order:
            tp = TensorPlan(
                n, src_dtype[n], out_dtype[n], shapes[n], fi, pos, pos + sizes[n], tuple(found[n])
            )
            entries[n] = (out_dtype[n], shapes[n], pos, pos + sizes[n])
            planned.append(tp)
            pos += sizes[n]
        header = encode_header(entries, {"format": "pt"})
        files.append(OutputFile(names[fi], header, len(header) + pos, tuple(order)))
        for tp in planned:
            moves.extend(tensor_moves(tp, len(header), headers))
        tensors.extend(planned)
    return ExportPlan(
        sources=tuple(h.path for h in headers),
        files=tuple(files),
        tensors=tuple(tensors),
        moves=tuple(split_and_merge(moves)),
        total_size=sum(sizes.values()),
    )


def _compile(pattern: str | None) -> re.Pattern[str] | None:
    if not pattern:
        return None
    try:
        return re.compile(pattern)
    except re.error as e:
        raise DTypeError(f"--keep-dtype {pattern!r} is not a valid regular expression: {e}") from None


def _check_expected(
    shapes: Mapping[str, tuple[int, ...]],
    src_dtype: Mapping[str, str],
    expected: Mapping[str, TensorInfo],
    where: str,
) -> None:
    missing = sorted(set(expected) - set(shapes), key=natural_key)
    if missing:
        raise PlanError(
            f"{len(missing)} marker tensors are in no shard (a shard is missing?): {missing[:5]}",
            path=where,
        )
    extra = sorted(set(shapes) - set(expected), key=natural_key)
    if extra:
        raise PlanError(
            f"{len(extra)} tensors in the shards are not in the commit marker: {extra[:5]}", path=where
        )
    for name, info in expected.items():
        if tuple(info.shape) != shapes[name]:
            raise PlanError(
                f"tensor {name!r}: shards cover {list(shapes[name])}, the trainer saved {list(info.shape)}"
                " (a shard is missing?)",
                path=where,
            )
        if info.dtype != src_dtype[name]:
            raise PlanError(
                f"tensor {name!r}: shards hold {src_dtype[name]}, the trainer saved {info.dtype}", path=where
            )


def _out_dtype(name: str, src: str, target: str | None, keep: re.Pattern[str] | None) -> str:
    if target is None or not dtypes.lookup(src).castable or (keep is not None and keep.search(name)):
        return src
    return target
