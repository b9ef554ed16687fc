"""Every block of every shard in flat arrays: a 100k-tensor checkpoint costs bytes per block, not objects.

Headers are consumed one at a time (each validated by `read_header` before any offset in it is used) and
dropped once their blocks are copied into the table, so reading the shards holds at most one shard's
header objects. `chunks_of` rebuilds the `Chunk`s of one tensor when the planner needs them.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from types import MappingProxyType

import numpy as np

from stagerd.contract.safetensors_format import Header
from stagerd.engine.plan_types import DTYPE_CODE, DTYPE_NAMES, ChunkTable, Names, frozen
from stagerd.errors import PlanError


def build_chunk_table(headers: Iterable[Header]) -> tuple[ChunkTable, dict[str, int]]:
    """The table of `headers` (consumed one by one), and name -> tensor id for the planner's lookups
    (its keys, in id order, are the names as str while planning; the table keeps them as one blob)."""
    sources: list[str] = []
    ids: dict[str, int] = {}
    blob, name_end = bytearray(), array("q")
    dtype = array("B")
    tensor, src, ndim = array("i"), array("i"), array("B")
    offset, at, dims = array("q"), array("q"), array("q")
    # Not enumerate(): it keeps its last (index, header) tuple until the next header has been read.
    for h in headers:
        i = len(sources)
        sources.append(h.path)
        offsets = h.dcp_offsets()
        for name, e in h.tensors.items():
            code = DTYPE_CODE[e.dtype]
            t = ids.setdefault(name, len(ids))
            if t == len(name_end):
                blob += name.encode()
                name_end.append(len(blob))
                dtype.append(code)
            elif dtype[t] != code:
                where = str(Path(sources[0]).parent)
                raise PlanError(
                    f"tensor {name!r} is {DTYPE_NAMES[dtype[t]]} in one shard and {e.dtype} in {h.path}",
                    path=where,
                )
            tensor.append(t)
            src.append(i)
            offset.append(h.data_start + e.begin)
            at.append(len(dims))
            ndim.append(len(e.shape))
            try:
                dims.extend(offsets[name])
                dims.extend(e.shape)
            except OverflowError:
                raise PlanError(
                    f"tensor {name!r}: an offset or dimension does not fit 64 bits", path=h.path
                ) from None
        del h, offsets  # the next shard's header must not sit beside this one's
    table = freeze_table(tuple(sources), blob, name_end, dtype, tensor, src, offset, at, ndim, dims)
    return table, ids


def freeze_table(
    sources: tuple[str, ...],
    blob: bytes | bytearray,
    name_end: array,
    dtype: array,
    tensor: Sequence[int],
    src: array,
    offset: array,
    at: array,
    ndim: array,
    dims: array,
    strided: Mapping[int, tuple[int, ...]] | None = None,
) -> ChunkTable:
    """The read-only table of columns filled chunk by chunk (`tensor` names each chunk's tensor id);
    `strided`: the source strides of the blocks that are not row-major (`Chunk.strides`)."""
    order, first = group_by_tensor(tensor, len(name_end))
    return ChunkTable(
        sources,
        Names(bytes(blob), frozen(name_end)),
        frozen(dtype),
        frozen(src),
        frozen(offset),
        frozen(at),
        frozen(ndim),
        frozen(dims),
        frozen(order),
        frozen(first),
        MappingProxyType(dict(strided or {})),
    )


def group_by_tensor(tensor: Sequence[int], n: int) -> tuple[array, array]:
    """A counting sort of block indices by tensor id, stable, so shard order stays within a tensor (in
    numpy: a loop per block was a tenth of a second per 100k blocks)."""
    ids = np.asarray(tensor, dtype=np.int64)
    first = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(np.bincount(ids, minlength=n), out=first[1:])
    order = np.argsort(ids, kind="stable").astype(np.int32)
    return array("i", order.tobytes()), array("q", first.tobytes())
