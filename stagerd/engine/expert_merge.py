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

The sums are torch's too (`engine/torch_sum.py`): in C (`_torchsum.c`) where it was built, every element
in torch's order; else BLAS's float32 product, fast, brackets torch's, and only the elements whose
bracket ends merge differently are summed in torch's order: in bf16 about one in two thousand, in
float32, whose every ulp shows, nearly all.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from stagerd.contract.lora_merge import ExpertLayout, LoraMerge
from stagerd.engine.merge_inputs import NP, opmath, promoted, read_rows, rounded
from stagerd.engine.plan_types import ChunkTable
from stagerd.engine.runner import pwrite_all
from stagerd.engine.torch_sum import merged


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
    step = max(1, block_bytes // max(1, cols * 8))  # the bracket holds several float32 copies of a block
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
            out = merged(left, right, w, finish, fused=fused)
            pwrite_all(fd, memoryview(out.tobytes()), at + ((e * rows + lo) * cols) * wdt.itemsize)


def _delta(product: np.ndarray, scaling: np.ndarray, ddt: np.dtype[Any], *, several: bool) -> np.ndarray:
    """scaling * product in the adapter's dtype `ddt`, kept wide: rounded as PEFT's einsum (several
    experts) or its Linear delta (one) rounds it."""
    if several:
        product = rounded(product, ddt)
    return rounded(np.multiply(product, scaling), ddt)
