"""The staged inputs of a LoRA merge (`engine/merge.py`), read a block at a time: rows of a matrix or of
one expert's matrix of a fused [experts, rows, cols] tensor, whole vectors, from whichever staged blocks
hold them (sharded along any dim), as numpy arrays; and the roundings that make numpy's arithmetic
torch's."""

from __future__ import annotations

import os
from typing import Any

import ml_dtypes
import numpy as np

from stagerd.contract.step.reopen import open_held
from stagerd.engine.plan_types import Chunk, ChunkTable
from stagerd.engine.runner import pread_into

NP: dict[str, np.dtype[Any]] = {
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F32": np.dtype(np.float32),
    "F64": np.dtype(np.float64),
}


def promoted(*dts: np.dtype[Any]) -> np.dtype[Any]:
    """torch's result dtype of an elementwise op on floating tensors of `dts` (F16 with BF16 is F32)."""
    if np.dtype(np.float64) in dts:
        return np.dtype(np.float64)
    return dts[0] if len(set(dts)) == 1 else np.dtype(np.float32)


def opmath(dt: np.dtype[Any]) -> np.dtype[Any]:
    """The dtype torch computes an elementwise op of `dt` tensors in: float32 for the half types."""
    return np.dtype(np.float64) if dt == np.float64 else np.dtype(np.float32)


def rounded(x: np.ndarray, dt: np.dtype[Any]) -> np.ndarray:
    """`x` rounded to `dt` (as torch stores an op's result), kept in `x`'s wider dtype."""
    return x if dt == x.dtype else x.astype(dt).astype(x.dtype)


def shape_of(table: ChunkTable, t: int) -> tuple[int, ...]:
    chunks = table.chunks_of(t)
    return tuple(max(c.global_offset[d] + c.shape[d] for c in chunks) for d in range(len(chunks[0].shape)))


def read_rows(
    table: ChunkTable, t: int, lo: int, hi: int, dt: np.dtype[Any], expert: int | None = None
) -> np.ndarray:
    """Rows [lo, hi) of the 2-dim staged tensor `t`, or of its matrix `expert` if it is 3-dim, from the
    blocks that hold them (tiling checked)."""
    chunks = table.chunks_of(t)
    cols = max(c.global_offset[-1] + c.shape[-1] for c in chunks)
    out = np.empty((hi - lo, cols), dtype=dt)
    for c in chunks:
        (r0, c0), (n, k) = c.global_offset[-2:], c.shape[-2:]
        skip = 0
        if expert is not None:  # a block of experts [e0, e0 + ne): its matrices one after another
            e0, ne = c.global_offset[0], c.shape[0]
            if not e0 <= expert < e0 + ne:
                continue
            skip = (expert - e0) * n * k
        a, b = max(lo, r0), min(hi, r0 + n)
        if a >= b or k == 0:
            continue
        buf = read_block(table, c, (skip + (a - r0) * k) * dt.itemsize, (b - a) * k * dt.itemsize)
        out[a - lo : b - lo, c0 : c0 + k] = np.frombuffer(buf, dtype=dt).reshape(b - a, k)
    return out


def read_vector(table: ChunkTable, t: int, dt: np.dtype[Any]) -> np.ndarray:
    """The whole 1-dim staged tensor `t` (a bias, a DoRA magnitude: one value per output)."""
    out = np.empty(shape_of(table, t)[0], dtype=dt)
    for c in table.chunks_of(t):
        (r0,), (n,) = c.global_offset, c.shape
        if n:
            out[r0 : r0 + n] = np.frombuffer(read_block(table, c, 0, n * dt.itemsize), dtype=dt)
    return out


def read_block(table: ChunkTable, c: Chunk, skip: int, nbytes: int) -> bytearray:
    """`nbytes` of the staged block `c`, from its byte `skip`."""
    buf = bytearray(nbytes)
    path = table.sources[c.src]
    fd = open_held(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        pread_into(fd, memoryview(buf), c.offset + skip, path)
    finally:
        os.close(fd)
    return buf
