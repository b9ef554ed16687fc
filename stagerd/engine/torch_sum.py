"""A LoRA product B @ A summed as torch sums it on CPU, bit for bit: the merges of `engine/merge.py` (a
Linear's, an Embedding's) and `engine/expert_merge.py` (fused experts) are PEFT's only if their sums are
torch's, and numpy's matmul sums in an order of its own, which depends on the block's shape.

Where setup.py built `_torchsum.c` (optional C), every element is summed in torch's order there, the rank
steps in order, each a C99 fmaf (unfused: the product rounded, then added): a 4096 x 4096 rank-16 merge takes
about 1.1x a numpy-matmul merge's time, float32 or bf16. Without it, numpy: BLAS's float32 product and a
bound on any order's error bracket torch's sum; a merge is monotone in the product, so where both ends of
the bracket merge to the same bits so does torch's sum, and only the other elements are summed in torch's
order, one rank step at a time in float64 (`summed`): in bf16 about one in two thousand (1.4x-1.8x
a numpy-matmul merge's time with bf16 adapters, 1.15x-1.5x with float32 ones on a bf16 base), in float32
nearly all (16x-30x). Both give the same bits.

This is torch's BLAS's order for every product of at least 16 rows and 16 columns (measured on an AMD
EPYC, AVX-512 and AVX2); a narrower one may take MKL's small-matrix kernels, whose order depends on the
CPU, and differ in the last bit."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from stagerd.engine.merge_inputs import rounded

try:
    from stagerd.engine import _torchsum
except ImportError:  # built without a C compiler (setup.py marks the extension optional)
    _torchsum = None  # type: ignore[assignment]

_U, _TINY = 2.0**-24, 2.0**-149  # float32's unit roundoff and least subnormal


def merged(
    left: np.ndarray,
    right: np.ndarray,
    w: np.ndarray,
    finish: Callable[[np.ndarray, np.ndarray], np.ndarray],
    *,
    fused: bool,
) -> np.ndarray:
    """finish(left @ right, w), the product summed as torch sums it on CPU: along the rank in order, in
    float32. `finish` maps the product (which it may overwrite) and the base's block `w` (or elements of
    it) to the merged values, monotone in the product. Any two orders' sums lie within 2(r+1) ulps of
    the sum of the products' magnitudes."""
    if left.dtype != np.float32:  # float64 adapters: BLAS's order, within an ulp of torch's
        return finish(np.matmul(left, right), w)
    if _torchsum is not None and right.dtype == np.float32:  # in torch's order, every element
        return finish(product(left, right, fused=fused), w)
    guess = np.matmul(left, right)
    r = left.shape[1]
    # All in float32: the bound's own roundings, and those of guess -/+ bound (half an ulp of a value no
    # larger than the magnitudes' sum), are within its 1% and 4u of slack.
    size = np.matmul(np.abs(left), np.abs(right))
    slack = np.float32((2 * r + 4) * _U * 1.01 + 4 * _U)
    bound = np.multiply(size, slack, out=size)
    bound += np.float32((2 * r + 8) * _TINY)
    down, up = guess - bound, np.add(guess, bound, out=guess)
    out, other = finish(down, w), finish(up, w)
    bits = np.dtype(f"u{out.dtype.itemsize}")
    ii, jj = np.divmod(np.flatnonzero(out.view(bits) != other.view(bits)), out.shape[1])  # 2-D's is slow
    chunk = max(1, (8 << 20) // (8 * r))  # gathered rank vectors of at most 8 MiB each
    for s in range(0, len(ii), chunk):
        i, j = ii[s : s + chunk], jj[s : s + chunk]
        out[i, j] = finish(summed(left[i], right[:, j].T, fused=fused), w[i, j])
    return out


def product(left: np.ndarray, right: np.ndarray, *, fused: bool) -> np.ndarray:
    """left @ right, float32 [m, r] @ [r, n], every element summed as `summed` sums it, in C."""
    left, right = np.ascontiguousarray(left), np.ascontiguousarray(right)
    (m, r), n = left.shape, right.shape[1]
    out = np.empty((m, n), dtype=np.float32)
    _torchsum.block(left, right, out, m, r, n, fused)
    return out


def summed(x: np.ndarray, y: np.ndarray, *, fused: bool) -> np.ndarray:
    """sum over k of x[:, k] * y[:, k] as torch sums it: in order, in float32, each step a fused
    multiply-add (its BLAS: the product exact in float64, the sum rounded once) or, `fused` False, the
    product rounded first (its own loop for a small bmm). In C where `_torchsum` was built: the same bits."""
    if _torchsum is not None and x.dtype == y.dtype == np.float32:
        x, y = np.ascontiguousarray(x), np.ascontiguousarray(y)
        out = np.empty(x.shape[0], dtype=np.float32)
        _torchsum.rows(x, y, out, x.shape[0], x.shape[1], fused)
        return out
    f32 = np.dtype(np.float32)
    xs, ys = x.T.astype(np.float64), y.T.astype(np.float64)  # a rank step's vectors contiguous
    acc = np.zeros(x.shape[0], dtype=np.float64)
    for k in range(x.shape[1]):
        product = np.multiply(xs[k], ys[k], out=xs[k])
        acc = rounded_once(acc, product if fused else rounded(product, f32)).astype(f32).astype(np.float64)
    return acc.astype(np.float32)


_LOW, _MID = np.uint64((1 << 29) - 1), np.uint64(1 << 28)  # float64's bits below float32's, a midpoint's
_SUBNORMAL = np.uint64(897 << 52)  # float64's exponent field of float32's least normal, 2^-126


def rounded_once(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a + b in float64 such that rounded to float32 it is a + b rounded once, as an FMA rounds it. Rounded
    to nearest in float64 first, a sum that lands on a float32 midpoint would round twice (1 + 2^-23 plus
    a product just under 2^-24 gives 1 + 2^-22, not 1 + 2^-23): there, and below float32's normal range
    where its midpoints are coarser, the sum is rounded to odd instead, which rounds on correctly."""
    s = a + b
    bits = s.view(np.uint64)
    risky = np.flatnonzero(((bits & _LOW) == _MID) | ((bits & ~np.uint64(1 << 63)) < _SUBNORMAL))
    if len(risky):
        s[risky] = _to_odd(a[risky], b[risky])
    return s


def _to_odd(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a + b rounded to odd in float64: where the sum is inexact, its neighbour with an odd last bit on
    the side of the exact sum."""
    s = a + b
    t = s - a
    err = (a - (s - t)) + (b - t)  # the sum's rounding error, exact (TwoSum)
    even = (s.view(np.uint64) & np.uint64(1)) == 0
    step = np.nextafter(s, np.where(err > 0, np.inf, -np.inf))
    return np.where((err != 0) & even, step, s)
