"""`plan()`: validated shard headers in, a frozen `ExportPlan` out. Pure: reads nothing, writes nothing.

Headers are taken one at a time into a `ChunkTable`; from then on every per-tensor fact (global shape, dtype,
place in the output) is a row of a flat array, and `Chunk`s exist only for the tensor being checked.
"""

from __future__ import annotations

import math
import re
from array import array
from collections.abc import Callable, Iterable, Mapping, Sequence

from stagerd.contract import dtypes
from stagerd.contract.commit_marker import TensorInfo
from stagerd.contract.hub_plan import Holds, HubPlan
from stagerd.contract.safetensors_format import Header
from stagerd.contract.sharding import (
    DEFAULT_MAX_SHARD_SIZE,
    natural_key,
    output_file_names,
    pack_in_order,
)
from stagerd.engine.chunk_table import build_chunk_table
from stagerd.engine.file_header import header_size, rows_header_size
from stagerd.engine.moves import tensor_moves
from stagerd.engine.natural_order import assign_in_natural_order, pack_in_natural_order
from stagerd.engine.plan_types import (
    DTYPE_CODE,
    DTYPE_NAMES,
    ChunkTable,
    ExportPlan,
    OutputFile,
    frozen,
)
from stagerd.engine.shapes import global_shapes
from stagerd.engine.tiling import check_tiling
from stagerd.engine.views import apply_views
from stagerd.errors import DTypeError, HubPlanError, PlanError


def plan(
    headers: Iterable[Header],
    *,
    dtype: str | None = None,
    keep_dtype: str | None = None,
    reference: Mapping[str, str] | None = None,
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
    expected: Mapping[str, TensorInfo] | None = None,
    out_dtypes: Mapping[str, str] | None = None,
    views: HubPlan | None = None,
) -> ExportPlan:
    """Turn validated shard headers into a frozen export plan. Pure: reads nothing, writes nothing.

    `headers` may be a generator: each is used and dropped before the next is read. `dtype` is a
    safetensors name (`BF16`) or None to keep; `keep_dtype` a regex of names never cast; `reference` a
    weight_map whose grouping to keep; `expected` the global dtype and shape of every tensor as the trainer
    saw it (from the commit marker), which catches a missing trailing shard; `out_dtypes` pins the output
    dtype of named tensors (verify uses it to re-derive an existing export); `views` the commit marker's
    to-Hub plan, applied once the staged tensors are checked (names, dtypes and files are then the Hub's);
    the outputs it leaves uncast for `dtype` (what the model's class keeps in float32) are kept, as
    `keep_dtype`'s are.
    """
    if dtype is not None:
        dt = dtypes.lookup(dtype)
        if not dt.castable:
            raise DTypeError(f"cannot export as {dtype}: only F32, F16, BF16 and F64 are cast targets")
    keep = _compile(keep_dtype)
    table, ids = build_chunk_table(headers)
    where = table.where
    names = list(ids)  # the dict's own keys, in id order: no second str per name
    shape_at, shape_ndim, dims, simple = global_shapes(table, names)

    def shape(t: int) -> tuple[int, ...]:
        return tuple(dims[shape_at[t] : shape_at[t] + shape_ndim[t]])

    if expected is not None:
        _check_expected(table, ids, shape, expected)
    for t in range(len(names)):
        if not simple[t]:  # the common layouts are checked by `global_shapes` in passing
            check_tiling(names[t], shape(t), table.chunks_of(t), where)
    if views is not None:
        table, ids = apply_views(table, ids, shape, views)
        names = list(ids)
        shape_at, shape_ndim, dims, _ = global_shapes(table, names)

    uncast = _uncast(views, dtype, ids, where)
    out_code = array(
        "B",
        (DTYPE_CODE[_out_dtype(n, table.dtype_name(t), dtype, keep, uncast)] for t, n in enumerate(names)),
    )
    named = _named_dtype(views, ids, out_code, uncast)
    for n, dt_name in (out_dtypes or {}).items():
        pinned = ids.get(n)
        if pinned is None:
            continue
        src_name = table.dtype_name(pinned)
        if dt_name != src_name and not (dtypes.lookup(src_name).castable and dtypes.lookup(dt_name).castable):
            raise DTypeError(f"tensor {n!r}: {src_name} cannot become {dt_name}", path=where)
        out_code[pinned] = DTYPE_CODE[dt_name]
    sizes = {
        n: dtypes.lookup(DTYPE_NAMES[out_code[t]]).nbytes(math.prod(shape(t))) for t, n in enumerate(names)
    }
    cast = any(out_code[t] != DTYPE_CODE[table.dtype_name(t)] for t in range(len(names)))
    shared = _shared(views, ids, out_code, sizes, cast, where)
    # save_pretrained's splitter counts each storage once, by its bytes (huggingface_hub's total_size)
    in_shared = {n for group, _ in shared for n in group}
    total_size = sum(b for n, b in sizes.items() if n not in in_shared) + sum(b for _, b in shared)
    if reference is None:
        order = _save_order(names, views, expected, where)
        if order is None:
            groups = pack_in_natural_order(sizes, max_shard_size)
        else:
            groups = pack_in_order(order, sizes, max_shard_size, shared)
    else:
        # each file's rows are sorted into the writer's order below, so the reference's own order is kept
        groups = assign_in_natural_order(sizes, reference, max_shard_size, ordered=False)
    file_names = output_file_names(len(groups))
    row_tensor, row_dst, row_begin, row_end = array("i"), array("B"), array("q"), array("q")
    files: list[OutputFile] = []
    for fi, group in enumerate(groups):
        # safetensors' own writer order (so a file is the bytes `save_pretrained` writes): dtypes in
        # descending enum order, widest first, which keeps every tensor aligned for mmap readers; then
        # names in code point order (`layers.10` before `layers.2`), not natural order.
        group.sort(key=lambda n: (-dtypes.writer_rank(DTYPE_NAMES[out_code[ids[n]]]), n))
        first, pos = len(row_tensor), 0
        for n in group:
            t = ids[n]
            row_tensor.append(t)
            row_dst.append(out_code[t])
            row_begin.append(pos)
            pos += sizes[n]
            row_end.append(pos)
        rows = (row_tensor[first:], row_dst[first:], row_begin[first:], row_end[first:])
        size = rows_header_size(table.names, dims, shape_at, shape_ndim, rows)
        if size is None:
            entries = ((names[t], DTYPE_NAMES[d], shape(t), b, e) for t, d, b, e in zip(*rows, strict=True))
            size = header_size(entries)
        files.append(OutputFile(file_names[fi], size, size + pos, first, len(row_tensor)))
        group.clear()  # the rows hold it now
    p = ExportPlan(
        chunks=table,
        files=tuple(files),
        tensor=frozen(row_tensor),
        dst_dtype=frozen(row_dst),
        begin=frozen(row_begin),
        end=frozen(row_end),
        shape_at=frozen(shape_at),
        shape_ndim=frozen(shape_ndim),
        dims=frozen(dims),
        total_size=total_size,
        parameters=views.parameters if views is not None else None,
        named_dtype=named,
    )
    _check_byte_addressable(p)
    return p


def _named_dtype(
    views: HubPlan | None, ids: Mapping[str, int], out_code: array[int], uncast: frozenset[str]
) -> str | None:
    """The dtype `save_pretrained` names the model by where a cast does not: its first floating parameter's
    (`PreTrainedModel.dtype`, the plan's `dtype_from`), when the cast leaves that one uncast (a model
    whose first module is held in float32, an audio tower say). None: the cast's."""
    first = None if views is None else views.dtype_from
    t = None if first is None or first not in uncast else ids.get(first)
    return None if t is None else DTYPE_NAMES[out_code[t]]


def _save_order(
    names: list[str], views: HubPlan | None, expected: Mapping[str, TensorInfo] | None, where: str
) -> Sequence[str] | None:
    """The order the trainer's own save fills its files in: the to-Hub plan's (save_pretrained's state
    dict), else the marker's (the state dict as saved); None where neither is known: natural key order."""
    if views is not None:
        if not views.order:
            return None
        if len(views.order) != len(names) or set(views.order) != set(names):
            raise HubPlanError("the plan's save order does not name exactly its output tensors", path=where)
        return views.order
    if expected is None or len(expected) != len(names):
        return None
    return list(expected)


def _shared(
    views: HubPlan | None,
    ids: Mapping[str, int],
    out_code: array,
    sizes: Mapping[str, int],
    cast: bool,
    where: str,
) -> list[tuple[tuple[str, ...], int]]:
    """The plan's shared storages that hold for this export, each with its bytes in the output dtype:
    those of the trainer's memory layout only where no tensor is cast (`cast`), those of a cast only
    where one is (`Holds`)."""
    holds = (Holds.ALWAYS, Holds.CAST if cast else Holds.KEPT)
    out = []
    seen: set[str] = set()
    for g in views.shared if views is not None else ():
        if g.holds not in holds:
            continue
        if not g.names or any(n not in ids for n in g.names):
            raise HubPlanError("a shared storage of the plan names a tensor it does not write", path=where)
        # the splitter would place a name's file twice, or a group's followers never (a tensor lost)
        twice = next((n for i, n in enumerate(g.names) if n in seen or n in g.names[:i]), None)
        if twice is not None:
            raise HubPlanError(f"two shared storages of the plan hold {twice!r}", path=where)
        seen.update(g.names)
        nbytes = dtypes.lookup(DTYPE_NAMES[out_code[ids[g.names[0]]]]).nbytes(g.numel)
        if any(sizes[n] > nbytes for n in g.names):
            raise HubPlanError(f"a shared storage of the plan is smaller than {g.names[0]!r}", path=where)
        out.append((g.names, nbytes))
    return out


def _check_byte_addressable(p: ExportPlan) -> None:
    """Sub-byte tensors must move in whole bytes; find out now, not halfway through writing."""
    for fi, f in enumerate(p.files):
        for r in range(f.first, f.stop):
            t = p.tensor[r]
            if dtypes.lookup(p.chunks.dtype_name(t)).bits % 8:
                tensor_moves(p.row(r, fi), f.header_size, p.chunks.where)


def _compile(pattern: str | None) -> re.Pattern[str] | None:
    if not pattern:
        return None
    try:
        return re.compile(pattern)
    except re.error as e:
        raise DTypeError(f"--keep-dtype {pattern!r} is not a valid regular expression: {e}") from None


def _check_expected(
    table: ChunkTable,
    ids: Mapping[str, int],
    shape: Callable[[int], tuple[int, ...]],
    expected: Mapping[str, TensorInfo],
) -> None:
    where = table.where
    missing = sorted((n for n in expected if n not in ids), key=natural_key)
    if missing:
        raise PlanError(
            f"{len(missing)} marker tensors are in no shard (a shard is missing?): {missing[:5]}",
            path=where,
        )
    extra = sorted((n for n in ids if n not in expected), key=natural_key)
    if extra:
        raise PlanError(
            f"{len(extra)} tensors in the shards are not in the commit marker: {extra[:5]}", path=where
        )
    for name, info in expected.items():
        t = ids[name]
        got = shape(t)
        if tuple(info.shape) != got:
            raise PlanError(
                f"tensor {name!r}: shards cover {list(got)}, the trainer saved {list(info.shape)}"
                " (a shard is missing?)",
                path=where,
            )
        if info.dtype != table.dtype_name(t):
            raise PlanError(
                f"tensor {name!r}: shards hold {table.dtype_name(t)}, the trainer saved {info.dtype}",
                path=where,
            )


def _uncast(views: HubPlan | None, target: str | None, ids: Mapping[str, int], where: str) -> frozenset[str]:
    """The outputs the plan leaves in their saved dtype under a cast to `target`; each must be an output."""
    names = frozenset(views.uncast_for(target)) if views is not None and target is not None else frozenset()
    missing = next((n for n in names if n not in ids), None)
    if missing is not None:
        raise HubPlanError(f"the plan keeps {missing!r} uncast, which it does not write", path=where)
    return names


def _out_dtype(
    name: str, src: str, target: str | None, keep: re.Pattern[str] | None, uncast: frozenset[str]
) -> str:
    if target is None or not dtypes.lookup(src).castable or name in uncast:
        return src
    return src if keep is not None and keep.search(name) else target
