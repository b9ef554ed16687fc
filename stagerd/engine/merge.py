"""Carry out a to-Hub plan's LoRA merges and zero fills (`contract/hub_plan.py`) before the export is planned.

A merge is arithmetic, not a byte move: W' = W + scaling * (B @ A) (its transpose with `fan_in_fan_out`),
as PEFT's `merge_and_unload` computes it. It runs here with numpy, never torch, in bounded memory: A and B
(rank r, so r x in and out x r) are read whole, W in row blocks of at most `block_bytes` (B's matching rows,
or A's matching columns with `fan_in_fan_out`). A plain merge is PEFT's bit for bit (`_merge_lora`): B @ A
summed as torch sums it (`engine/torch_sum.py`), in float32 (float64 if an input is F64), the delta
rounded to B's dtype, added in place as a Linear adds it (rounded once to W's dtype) or cast to W's dtype
first as an Embedding does (`delta_to_base`). DoRA scales each output of W + delta by its magnitude over
its L2 norm, the delta a Linear's and the norm summed as torch sums it (`engine/torch_norm.py`), bit for
bit too; with `fan_in_fan_out` an output is a column, so its norms take a first pass over the row
blocks. A LoRA bias (base + scaling * B's bias) is a vector, read whole,
bit for bit. A MoE's fused experts adapted with `target_parameters` merge one expert at a time, bit for
bit (`engine/expert_merge.py`). The merged tensors are written, block by block, into one scratch shard (a
DCP-style safetensors file beside the output); its header joins the staged shards' for the planner, so
the views, casts and file packing treat a merged tensor like any staged one.

A zero fill (`ZeroFill`: the padding a conversion appends) has its place in the same scratch shard and is
never written: the file is extended to its full size with ftruncate, so its bytes are a hole that reads
as zeros and takes no disk. Views read it as they read a staged tensor, so the planner's copy and cast
moves write the padding at copy speed and nothing holds it whole.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from stagerd.contract import dtypes
from stagerd.contract.commit_marker import TensorInfo
from stagerd.contract.hub_plan import HubPlan, ZeroFill
from stagerd.contract.lora_merge import LoraMerge, MergeKind
from stagerd.contract.safetensors_format import (
    DCP_SHARDING_INFO_KEY,
    SAVED_OFFSETS_KEY,
    Header,
    read_header,
)
from stagerd.engine import torch_norm, torch_sum
from stagerd.engine.cast import cast_into
from stagerd.engine.chunk_table import build_chunk_table
from stagerd.engine.expert_merge import merge_experts
from stagerd.engine.merge_inputs import NP, promoted, read_rows, read_vector, rounded, shape_of
from stagerd.engine.plan_types import ChunkTable
from stagerd.engine.runner import pwrite_all
from stagerd.errors import HubPlanError, OutputError

BLOCK_BYTES = 32 << 20
SCRATCH_NAME = "merged.safetensors"


# Beside export.tmp/ in the step directory; a killed export leaves it, and the next export removes it.
MERGE_SCRATCH_PREFIX = ".stagerd-merge-"


@contextlib.contextmanager
def lora_merges(
    headers: Iterable[Header],
    views: HubPlan | None,
    expected: Mapping[str, TensorInfo] | None,
    scratch_parent: Path | None,
    *,
    block_bytes: int | None = None,
) -> Iterator[tuple[list[Header], Mapping[str, TensorInfo] | None]]:
    """With `views`' merges computed into a scratch shard that also holds its zero fills (in a temporary
    directory under `scratch_parent`, removed on exit): the headers to plan with besides the staged
    shards' (`headers`, consumed only if there is a scratch shard), and `expected` with its tensors added."""
    if views is None or not (views.merges or views.zeros):
        yield [], expected
        return
    table, ids = build_chunk_table(headers)
    with tempfile.TemporaryDirectory(prefix=MERGE_SCRATCH_PREFIX, dir=scratch_parent) as d:
        path = Path(d) / SCRATCH_NAME
        block = BLOCK_BYTES if block_bytes is None else block_bytes
        header = write_merged(table, ids, views.merges, path, block_bytes=block, zeros=views.zeros)
        del table, ids
        yield [header], with_merged(expected, header)


def with_merged(expected: Mapping[str, TensorInfo] | None, header: Header) -> Mapping[str, TensorInfo] | None:
    """`expected` (the marker's tensors, if checked) with the merged tensors of the scratch `header` added."""
    if expected is None:
        return None
    merged = {name: TensorInfo(e.dtype, tuple(e.shape)) for name, e in header.tensors.items()}
    return {**expected, **merged}


def write_merged(
    table: ChunkTable,
    ids: Mapping[str, int],
    merges: Iterable[LoraMerge],
    path: Path,
    *,
    block_bytes: int = BLOCK_BYTES,
    zeros: Iterable[ZeroFill] = (),
) -> Header:
    """Compute every merge into the safetensors file `path` (offsets 0: each tensor whole), with a hole
    for each zero fill, and return its validated header."""
    merges = list(merges)
    header = write_scratch_header(table, ids, merges, path, zeros=zeros)
    merge_into(table, ids, merges, path, header, block_bytes=block_bytes)
    return header


def write_scratch_header(
    table: ChunkTable,
    ids: Mapping[str, int],
    merges: Iterable[LoraMerge],
    path: Path,
    *,
    zeros: Iterable[ZeroFill] = (),
) -> Header:
    """Create the scratch file `path` at its full size with its header and no merged data yet (a sparse
    tail), and return its validated header: the plan needs only this, the data only a file that reads it
    (`merge_into`), which a fleet node computes for its own files alone. The zero fills' bytes stay a
    hole: every node's scratch reads them as zeros."""
    where = table.where
    shapes = {n: shape_of(table, t) for n, t in ids.items()}
    entries: dict[str, Any] = {}
    pos = 0
    for m in merges:
        m.check(shapes, path=where)
        if m.name in ids or m.name in entries:
            raise HubPlanError(f"the merge {m.name!r} would replace a tensor of that name", path=where)
        dt = m.dtype if m.kind is MergeKind.CAST else table.dtype_name(ids[m.base])
        for n in m.inputs:
            if table.dtype_name(ids[n]) not in NP:
                raise HubPlanError(f"merge {m.name!r}: {n!r} is not floating point", path=where)
        size = NP[dt].itemsize * math.prod(shapes[m.base])
        entries[m.name] = {"dtype": dt, "shape": list(shapes[m.base]), "data_offsets": [pos, pos + size]}
        pos += size
    for z in zeros:
        z.check(path=where)
        if z.name in ids or z.name in entries:
            raise HubPlanError(f"the zero fill {z.name!r} would replace a tensor of that name", path=where)
        size = dtypes.lookup(z.dtype).nbytes(math.prod(z.shape))
        entries[z.name] = {"dtype": z.dtype, "shape": list(z.shape), "data_offsets": [pos, pos + size]}
        pos += size
    info = {n: {SAVED_OFFSETS_KEY: [0] * len(e["shape"])} for n, e in entries.items()}
    head = json.dumps({"__metadata__": {DCP_SHARDING_INFO_KEY: json.dumps(info)}, **entries}).encode()
    head += b" " * (-len(head) % 8)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as e:
        raise OutputError(f"cannot create the export's scratch shard: {e.strerror}", path=path) from None
    try:
        pwrite_all(fd, memoryview(len(head).to_bytes(8, "little") + head), 0)
        os.ftruncate(fd, 8 + len(head) + pos)
    except OSError as e:
        raise OutputError(f"cannot write the export's scratch shard: {e.strerror}", path=path) from None
    finally:
        os.close(fd)
    return read_header(path)


def merge_into(
    table: ChunkTable,
    ids: Mapping[str, int],
    merges: Iterable[LoraMerge],
    path: Path,
    header: Header,
    *,
    block_bytes: int = BLOCK_BYTES,
) -> None:
    """Compute `merges` (some or all of the scratch file's) into their places in `path`."""
    shapes = {n: shape_of(table, t) for n, t in ids.items()}
    try:
        fd = os.open(path, os.O_WRONLY)
    except OSError as e:
        raise OutputError(f"cannot open the export's scratch shard: {e.strerror}", path=path) from None
    try:
        for m in merges:
            at = header.data_start + header.tensors[m.name].begin
            _merge_one(table, ids, shapes, m, fd, at, block_bytes)
    except OSError as e:
        raise OutputError(f"cannot write the export's scratch shard: {e.strerror}", path=path) from None
    finally:
        os.close(fd)


def merge_reads(table: ChunkTable, ids: Mapping[str, int], m: LoraMerge) -> Iterator[tuple[str, int, int]]:
    """(shard path, byte offset, length) of every staged block that the merge `m` reads."""
    for n in m.inputs:
        t = ids[n]
        size = NP[table.dtype_name(t)].itemsize
        for c in table.chunks_of(t):
            yield table.sources[c.src], c.offset, size * math.prod(c.shape)


def _merge_one(
    table: ChunkTable,
    ids: Mapping[str, int],
    shapes: Mapping[str, tuple[int, ...]],
    m: LoraMerge,
    fd: int,
    at: int,
    block_bytes: int,
) -> None:
    if m.kind is MergeKind.EXPERTS:
        merge_experts(table, ids, shapes, m, fd, at, block_bytes)
        return
    if m.kind is MergeKind.CAST:
        _cast(table, ids[m.base], shapes[m.base], m.dtype, fd, at, block_bytes)
        return
    dts = [NP[table.dtype_name(ids[n])] for n in m.inputs]
    wdt, bdt = dts[0], dts[-1] if m.kind is MergeKind.BIAS else dts[2]
    wide = np.dtype(np.float64) if np.dtype(np.float64) in dts else np.dtype(np.float32)
    scaling = np.asarray(m.scaling, dtype=wide)
    if m.kind is MergeKind.BIAS:  # PEFT: base.bias += lora_B.bias * scaling, the product in B's dtype
        w, b = (read_vector(table, ids[n], dt) for n, dt in zip(m.inputs, dts, strict=True))
        delta = np.multiply(b.astype(wide), scaling).astype(bdt)
        pwrite_all(fd, memoryview(np.add(w.astype(wide), delta.astype(wide)).astype(wdt).tobytes()), at)
        return
    rows, cols = shapes[m.base]
    a = read_rows(table, ids[m.a], 0, shapes[m.a][0], dts[1]).astype(wide)
    b = read_rows(table, ids[m.b], 0, shapes[m.b][0], bdt).astype(wide)
    step = max(1, block_bytes // max(1, cols * 8))  # the bracket's float64 at most: 8 bytes a value
    blocks = [(lo, min(rows, lo + step)) for lo in range(0, rows, step)]

    if m.kind is MergeKind.LORA:
        _merge_lora(table, ids, m, a, b, (wdt, bdt), scaling, blocks, fd, at)
        return
    _merge_dora(table, ids, m, a, b, (wdt, bdt, dts[3]), scaling, blocks, fd, at)


def _cast(
    table: ChunkTable, t: int, shape: tuple[int, ...], dtype: str, fd: int, at: int, block_bytes: int
) -> None:
    """The matrix `t` cast to `dtype` as torch's `.to()` casts it (`engine/cast.py`), by row blocks."""
    src = table.dtype_name(t)
    rows, cols = shape
    out_size = NP[dtype].itemsize
    step = max(1, block_bytes // max(1, cols * max(NP[src].itemsize, out_size)))
    for lo in range(0, rows, step):
        block = read_rows(table, t, lo, min(rows, lo + step), NP[src]).tobytes()
        out = bytearray(len(block) // NP[src].itemsize * out_size)
        if src == dtype:  # `.to()` of a tensor already of that dtype: the same bytes
            out[:] = block
        else:
            cast_into(memoryview(block), memoryview(out), src, dtype)
        pwrite_all(fd, memoryview(out), at + lo * cols * out_size)


def _merge_dora(
    table: ChunkTable,
    ids: Mapping[str, int],
    m: LoraMerge,
    a: np.ndarray,
    b: np.ndarray,
    dts: tuple[np.dtype[Any], np.dtype[Any], np.dtype[Any]],
    scaling: np.ndarray,
    blocks: list[tuple[int, int]],
    fd: int,
    at: int,
) -> None:
    """PEFT's `DoraLinearVariant.merge_unsafe` (or its Embedding's) bit for bit: the delta as a Linear's
    (`_merge_lora`), W + delta and its norm per output in torch's promoted dtype of the two, the norm
    summed as torch sums it (`engine/torch_norm.py`), magnitude / norm in the promoted dtype of the
    magnitude and the norm, times W + delta rounded there, then to W's dtype. With `fan_in_fan_out` (and an
    Embedding) an output is a column of W: its norms take a first pass over the row blocks."""
    wdt, bdt, mdt = dts
    wide = scaling.dtype
    summed = promoted(wdt, bdt)
    factor_dt = promoted(mdt, summed)
    mag = read_vector(table, ids[m.magnitude], mdt).astype(wide)
    cols = a.shape[1] if not m.fan_in_fan_out else b.shape[0]
    delta_of = _delta_of(scaling, bdt)

    def block(lo: int, hi: int) -> np.ndarray:
        """W + delta on rows [lo, hi) rounded to `summed`, in `wide`."""
        w = read_rows(table, ids[m.base], lo, hi, wdt).astype(wide)
        delta = torch_sum.merged(*_operands(m, a, b, lo, hi), w, delta_of, fused=True)
        return rounded(np.add(w, delta, out=delta), summed)

    def factor(norm: np.ndarray, mag: np.ndarray) -> np.ndarray:
        return rounded(np.divide(mag, norm), factor_dt)

    if m.fan_in_fan_out:  # each output is a column of W: its norm needs every row block first
        columns = torch_norm.Columns(cols, summed)
        for lo, hi in blocks:
            columns.add(block(lo, hi))
        by_column = factor(columns.norms(wide), mag)[None, :]
    for lo, hi in blocks:
        s = block(lo, hi)
        f = by_column if m.fan_in_fan_out else factor(torch_norm.rows(s, summed), mag[lo:hi])[:, None]
        out = rounded(np.multiply(f, s), factor_dt).astype(wdt)
        pwrite_all(fd, memoryview(out.tobytes()), at + lo * cols * wdt.itemsize)


def _delta_of(scaling: np.ndarray, bdt: np.dtype[Any]) -> Callable[[np.ndarray, np.ndarray], np.ndarray]:
    """`torch_sum.merged`'s finish for the delta alone: the product times scaling, rounded to B's dtype
    (PEFT's `get_delta_weight`); monotone in the product."""

    def finish(product: np.ndarray, _w: np.ndarray) -> np.ndarray:
        return rounded(np.multiply(product, scaling, out=product), bdt)

    return finish


def _operands(m: LoraMerge, a: np.ndarray, b: np.ndarray, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
    """(left, right) whose product is B @ A's for W's rows [lo, hi): with fan_in_fan_out W is in x out, its
    rows (B @ A)'s columns."""
    return (a[:, lo:hi].T, b.T) if m.fan_in_fan_out else (b[lo:hi], a)


def _merge_lora(
    table: ChunkTable,
    ids: Mapping[str, int],
    m: LoraMerge,
    a: np.ndarray,
    b: np.ndarray,
    dts: tuple[np.dtype[Any], np.dtype[Any]],
    scaling: np.ndarray,
    blocks: list[tuple[int, int]],
    fd: int,
    at: int,
) -> None:
    """PEFT's `Linear.merge` (or `Embedding.merge`, `delta_to_base`) bit for bit, a row block at a time:
    the delta is `get_delta_weight`'s, B @ A summed as torch sums it (`engine/torch_sum.py`), times
    scaling, rounded to B's dtype; a Linear adds it to W in place, the sum rounded once to W's dtype, an
    Embedding first casts it to W's dtype."""
    wdt, bdt = dts
    wide = scaling.dtype
    delta_of = _delta_of(scaling, bdt)

    def finish(product: np.ndarray, w: np.ndarray) -> np.ndarray:
        """The merged values from the product's and W's, widened: each step monotone in the product."""
        delta = delta_of(product, w)
        if m.delta_to_base:
            delta = rounded(delta, wdt)
        return np.add(w, delta, out=delta).astype(wdt)

    cols = a.shape[1] if not m.fan_in_fan_out else b.shape[0]
    for lo, hi in blocks:
        w = read_rows(table, ids[m.base], lo, hi, wdt).astype(wide)  # widened once, not per finish
        out = torch_sum.merged(*_operands(m, a, b, lo, hi), w, finish, fused=True)
        pwrite_all(fd, memoryview(out.tobytes()), at + lo * cols * wdt.itemsize)  # one block: bounded
