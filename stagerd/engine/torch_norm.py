"""The L2 norms DoRA's merge divides by (`torch.linalg.norm(W + delta, dim=1)`), summed as torch's CPU
kernel sums them, bit for bit: numpy's own sums (pairwise, or in float64) leave the merged weights an ulp
or two from `merge_and_unload`'s.

torch (`norm_kernel_tensor_iterator_impl`, ATen's ReduceOpsKernel.cpp) sums a norm one of two ways:
- Over a contiguous row of float32, float64 or bf16 (a Linear's weight): vectorized. Lanes of float (8)
  or double (4) each sum x * x over the row's whole vectors in order, the square rounded, then added; the
  lanes are added left to right, then the tail after the last whole vector in order; the square root is
  rounded to the input's dtype. bf16 loads 16 values at a time and adds them as two float vectors of 8,
  the first half first. The tail is a scalar loop, which the compiler built torch's AVX2 kernels with
  turned into groups of 4 squares rounded then added in order, and a last 1-3 each a fused multiply-add
  (a float64 tail: all fused). Its default kernel adds every square rounded.
- Otherwise (a column: `fan_in_fan_out` and an Embedding reduce over a strided dim; float16 rows): one
  accumulator, in order, in float32 (float64 for float64), the squares rounded.

torch picks its AVX2 kernels (also under AVX512, where this reduction runs as AVX2's) where the CPU has
AVX2 and FMA, or as `ATEN_CPU_CAPABILITY` says: the tail follows the same choice (`fused_tail`).
Measured against torch 2.13 on x86-64 under each capability: equal, but a float64 row's fused tail (rare:
float64 adapters), which is added rounded here. Elsewhere (aarch64) the tail is added rounded and may
differ from torch's in the last bit."""

from __future__ import annotations

import functools
import os
import platform
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from stagerd.engine.merge_inputs import opmath, rounded
from stagerd.engine.torch_sum import rounded_once

_LANES = {np.dtype(np.float32): (8, 8), np.dtype(np.float64): (4, 4), np.dtype(ml_dtypes.bfloat16): (16, 8)}


def rows(s: np.ndarray, dt: np.dtype[Any]) -> np.ndarray:
    """The norm of each row of `s` (values of `dt`, held in a wider float dtype or in `dt`'s opmath), as
    torch sums a contiguous row of `dt`: in lanes, or in order where it has no vectorized kernel
    (float16); rounded to `dt`, in `s`'s dtype."""
    if dt not in _LANES:
        in_order = Columns(s.shape[0], dt)
        in_order.add(s.T)
        return in_order.norms(s.dtype)
    load, lanes = _LANES[dt]
    acc_dt = opmath(dt)
    x = s.astype(acc_dt, copy=False)
    n, size = x.shape
    whole = size - size % load
    acc = np.zeros((n, lanes), dtype=acc_dt)
    for d in range(0, whole, lanes):  # a load of 16 bf16 values is two float vectors, in order
        v = x[:, d : d + lanes]
        acc += v * v
    total = acc[:, 0].copy()
    for j in range(1, lanes):
        total += acc[:, j]
    tail = size - whole
    fused = whole + tail - tail % 4 if fused_tail() and acc_dt == np.float32 else size
    for d in range(whole, size):
        v = x[:, d]
        if d < fused:
            total += v * v
        else:  # one rounding, as an FMA: the square exact in float64
            total = rounded_once(total.astype(np.float64), np.square(v, dtype=np.float64)).astype(acc_dt)
    return rounded(np.sqrt(total), dt).astype(s.dtype, copy=False)


class Columns:
    """The norm of each column of a matrix fed a row block at a time, in row order (`add`), as torch sums
    a reduction over a strided dim, or a row of float16: one accumulator each, in order."""

    def __init__(self, cols: int, dt: np.dtype[Any]) -> None:
        self.dt = dt
        self._acc = np.zeros(cols, dtype=opmath(dt))

    def add(self, block: np.ndarray) -> None:
        x = block.astype(self._acc.dtype, copy=False)
        for row in x:
            self._acc += row * row

    def norms(self, like: np.dtype[Any]) -> np.ndarray:
        return rounded(np.sqrt(self._acc), self.dt).astype(like, copy=False)


@functools.cache
def fused_tail() -> bool:
    """Whether torch runs its AVX2 kernels here: `ATEN_CPU_CAPABILITY` where set, else an x86-64 CPU with
    AVX2 and FMA (as torch's own dispatch decides)."""
    chosen = os.environ.get("ATEN_CPU_CAPABILITY", "").lower()
    if chosen:
        return chosen in ("avx2", "avx512")
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    try:
        info = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return False
    flags = next((ln.split(":", 1)[1].split() for ln in info.splitlines() if ln.startswith("flags")), [])
    return "avx2" in flags and "fma" in flags
