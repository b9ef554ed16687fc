"""An `EXPERTS` LoRA merge (`contract/lora_merge.py`): PEFT's `ParamWrapper.merge` of a parameter adapted
with `target_parameters`, a MoE's fused experts [experts, out, in] or [experts, in, out], or one matrix.

Each expert e gains scaling * (B_e @ A_e), A_e rows e*r..(e+1)*r of A, B_e the columns e, e+experts, ...
of B (PEFT reshapes B to (out, r, experts)). It runs one expert and one row block of it at a time: B is
read whole (out x r*experts, small), A_e per expert, the base's rows per block, so memory is bounded by
`block_bytes` and B whatever the number of experts.

The roundings are PEFT's on CPU. Several experts: its einsum's product is rounded to the adapter's dtype,
times scaling rounded again (torch's einsum sums in float32 for the half types, as here); one matrix:
`Linear.get_delta_weight`, the product and scaling in float32 for the half types, rounded once. Then the
delta is cast to the base's dtype before it is added (`get_delta_weight`'s `.to(param.dtype)`), which a
Linear's merge does not do: a float32 adapter on a bf16 base rounds twice here.

The sums are torch's too (`_merged`): BLAS's float32 product, fast, brackets torch's, and only the
elements whose bracket ends merge differently are summed in torch's order, one rank step at a time. A
bf16 merge re-sums about one element in two thousand (about 1.6x a plain BLAS merge's time); a float32
merge, whose every ulp shows, nearly all (about 20x).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from stagerd.contract.lora_merge import ExpertLayout, LoraMerge
from stagerd.engine.merge_inputs import NP, opmath, promoted, read_rows, rounded
from stagerd.engine.plan_types import ChunkTable
from stagerd.engine.runner import pwrite_all


def merge_experts(
    table: ChunkTable,
    ids: Mapping[str, int],
    shapes: Mapping[str, tuple[int, ...]],
    m: LoraMerge,
    fd: int,
    at: int,
    block_bytes: int,
) -> None:
    """Write the merge `m` at byte `at` of `fd`, one block of one expert at a time."""
    wdt, adt, bdt = (NP[table.dtype_name(ids[n])] for n in m.inputs)
    base, n = shapes[m.base], m.experts
    rows, cols = base[-2:]
    r = shapes[m.a][0] // n
    ddt = promoted(adt, bdt)  # the delta's dtype: the adapter's
    wide, add = opmath(ddt), opmath(wdt)
    scaling = np.asarray(m.scaling, dtype=wide)  # torch casts a Python scalar to the op's compute dtype
    b = read_rows(table, ids[m.b], 0, shapes[m.b][0], bdt).astype(wide)
    step = max(1, block_bytes // max(1, cols * 8))  # a block's bounds are float64
    # torch's bmm (the einsum's) runs rank x out x in under 400 in a loop of its own, the rest in BLAS;
    # one matrix is a Linear's mm, always BLAS.
    fused = n == 1 or r * rows * cols >= 400

    def finish(product: np.ndarray, w: np.ndarray) -> np.ndarray:
        """The merged values from the product's: each step monotone in it."""
        delta = rounded(_delta(product, scaling, ddt, several=n > 1), wdt)
        return np.add(w.astype(add), delta.astype(add)).astype(wdt)

    for e in range(n):
        a = read_rows(table, ids[m.a], e * r, (e + 1) * r, adt).astype(wide)
        b_e = b[:, e::n]
        for lo in range(0, rows, step):
            hi = min(rows, lo + step)
            w = read_rows(table, ids[m.base], lo, hi, wdt, e if len(base) == 3 else None)
            # Each expert's matrix is in x out with `eio`: its rows are the product's columns.
            left, right = (b_e[lo:hi], a) if m.layout is ExpertLayout.EOI else (a[:, lo:hi].T, b_e.T)
            out = _merged(left, right, w, finish, fused=fused)
            pwrite_all(fd, memoryview(out.tobytes()), at + ((e * rows + lo) * cols) * wdt.itemsize)


_U, _TINY = 2.0**-24, 2.0**-149  # float32's unit roundoff and least subnormal


def _merged(
    left: np.ndarray,
    right: np.ndarray,
    w: np.ndarray,
    finish: Callable[[np.ndarray, np.ndarray], np.ndarray],
    *,
    fused: bool,
) -> np.ndarray:
    """finish(left @ right, w), the product summed as torch sums it on CPU: along the rank in order, in
    float32. BLAS sums it fast in an order of its own; any two orders' sums lie within 2(r+1) ulps of the
    sum of the products' magnitudes, which brackets torch's. Where both ends of that bracket finish the
    same, so does torch's sum (`finish` is monotone); only the other elements are summed in torch's order,
    one rank step at a time: in bf16 a few, in float32 most."""
    guess = np.matmul(left, right)
    if left.dtype != np.float32:  # float64 adapters: BLAS's order, within an ulp of torch's
        return finish(guess, w)
    r = left.shape[1]
    size = np.matmul(np.abs(left), np.abs(right)).astype(np.float64)
    bound = size * ((2 * r + 4) * _U * 1.01) + (2 * r + 4) * _TINY
    down = np.nextafter((guess - bound).astype(np.float32), np.float32(-np.inf))
    up = np.nextafter((guess + bound).astype(np.float32), np.float32(np.inf))
    out, other = finish(down, w), finish(up, w)
    bits = np.dtype(f"u{out.dtype.itemsize}")
    ii, jj = np.nonzero(out.view(bits) != other.view(bits))
    chunk = max(1, (8 << 20) // (8 * r))  # gathered rank vectors of at most 8 MiB each
    for s in range(0, len(ii), chunk):
        i, j = ii[s : s + chunk], jj[s : s + chunk]
        out[i, j] = finish(_summed(left[i], right[:, j].T, fused=fused), w[i, j])
    return out


def _summed(x: np.ndarray, y: np.ndarray, *, fused: bool) -> np.ndarray:
    """sum over k of x[:, k] * y[:, k] as torch sums it: in order, in float32, each step a fused
    multiply-add (its BLAS: the product exact in float64, the sum rounded once) or, `fused` False, the
    product rounded first (its own loop for a small bmm)."""
    f32 = np.dtype(np.float32)
    acc = np.zeros(x.shape[0], dtype=np.float64)
    for k in range(x.shape[1]):
        product = x[:, k].astype(np.float64) * y[:, k].astype(np.float64)
        acc = rounded(acc + (product if fused else rounded(product, f32)), f32)
    return acc.astype(np.float32)


def _delta(product: np.ndarray, scaling: np.ndarray, ddt: np.dtype[Any], *, several: bool) -> np.ndarray:
    """scaling * product in the adapter's dtype `ddt`, kept wide: rounded as PEFT's einsum (several
    experts) or its Linear delta (one) rounds it."""
    if several:
        product = rounded(product, ddt)
    return rounded(np.multiply(product, scaling), ddt)
