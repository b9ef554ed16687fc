"""The cast kernel: F32, F16, BF16 and F64 in any direction, in place in the caller's buffers, without torch.

numpy (and `ml_dtypes` for bfloat16) already round to nearest even, handle overflow to inf, subnormals and
ties; their loops run without the GIL, so the export threads cast in parallel. But numpy's float16 loops are
scalar (0.5-1 GB/s against 8-30 for the others), so F32 <-> F16 and BF16 <-> F16 go to `_halfcast.c`, an
optional C extension using the F16C instructions (17-59 GB/s, also without the GIL), whenever it was built
and the CPU has F16C; numpy remains the fallback, and both are held to the same rules. What numpy does
differently from torch's `.to()` is NaN bit patterns, and the double rounding torch does from F64:

- torch narrows F64 to F32 first, then to the 16-bit type (two roundings); so do we, through F32.
- NaNs (found with one `max` over the wide side, so a NaN-free buffer pays a single vectorised pass):
  - into F16: quiet, sign and top payload bits kept (`sign | 0x7e00 | payload >> 13`, what F16C does);
  - into BF16 from F32 or F64: all ones (`0xffff`, torch's vectorised CPU kernel);
  - into BF16 from F16: `0x7fc0` (torch goes through its scalar float -> bfloat16 conversion);
  - into F32 or F64 from F16: the quiet bit is set.

`tests/engine/test_cast_kernel.py` holds every one of these to torch bit for bit, through the extension and
through numpy: every 16-bit pattern, millions of random F32 and F64 patterns, and hand-picked ties, overflows
and subnormals.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np

try:
    from stagerd.engine import _halfcast
except ImportError:  # built without a C compiler (setup.py marks the extension optional)
    _halfcast = None  # type: ignore[assignment]

_FLOAT: dict[str, np.dtype[Any]] = {
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F32": np.dtype(np.float32),
    "F64": np.dtype(np.float64),
}
_BITS: dict[int, np.dtype[Any]] = {2: np.dtype(np.uint16), 4: np.dtype(np.uint32), 8: np.dtype(np.uint64)}
CAST_DTYPES = frozenset(_FLOAT)
# The F16 directions numpy runs in scalar loops go to the F16C kernel (_halfcast.c) where it was built and
# the CPU has it; STAGERD_NO_HALFCAST=1 keeps them in numpy, to compare the two.
_COMPILED: dict[tuple[str, str], Callable[[memoryview, memoryview], None]] = (
    {
        ("F32", "F16"): _halfcast.f32_to_f16,
        ("F16", "F32"): _halfcast.f16_to_f32,
        ("BF16", "F16"): _halfcast.bf16_to_f16,
        ("F16", "BF16"): _halfcast.f16_to_bf16,
    }
    if _halfcast is not None and _halfcast.F16C and os.environ.get("STAGERD_NO_HALFCAST", "0") == "0"
    else {}
)
# Two-step casts go through F32 in blocks this long: small enough to stay in cache, big enough to vectorise.
_BLOCK = 1 << 15


def can_cast(src_dtype: str, dst_dtype: str) -> bool:
    """Whether the kernel converts `src_dtype` into `dst_dtype` (safetensors names)."""
    return src_dtype in _FLOAT and dst_dtype in _FLOAT


def cast_into(src: memoryview, dst: memoryview, src_dtype: str, dst_dtype: str) -> None:
    """Write `src` (elements of `src_dtype`) converted to `dst_dtype` into `dst`, bit-exact with torch."""
    s = np.frombuffer(src, dtype=_FLOAT[src_dtype])
    d = np.frombuffer(dst, dtype=_FLOAT[dst_dtype])
    if s.shape != d.shape:
        raise ValueError(f"cast of {s.size} {src_dtype} elements into room for {d.size} {dst_dtype}")
    compiled = _COMPILED.get((src_dtype, dst_dtype))
    if compiled is not None:
        compiled(src, dst)
        return
    narrow_to_narrow = s.itemsize == 2 and d.itemsize == 2
    if narrow_to_narrow or (src_dtype == "F64" and d.itemsize == 2):
        scratch = np.empty(min(_BLOCK, s.size), dtype=np.float32)
        for i in range(0, s.size, _BLOCK):
            w = scratch[: min(_BLOCK, s.size - i)]
            _convert(w, s[i : i + w.size])
            _narrow(d[i : i + w.size], w, nan_bf16=0x7FC0 if src_dtype == "F16" else 0xFFFF)
    elif d.itemsize == 2:
        _narrow(d, s, nan_bf16=0xFFFF)
    else:
        _convert(d, s)
        if src_dtype == "F16" and _has_nan(d):
            bits = d.view(_BITS[d.itemsize])
            quiet = 1 << (np.finfo(d.dtype).nmant - 1)
            nan = np.isnan(d)
            bits[nan] |= bits.dtype.type(quiet)


def _convert(out: np.ndarray, values: np.ndarray) -> None:
    with np.errstate(all="ignore"):  # overflow to inf is the rounding rule, not an accident
        np.copyto(out, values, casting="unsafe")


def _has_nan(wide: np.ndarray) -> bool:
    return bool(wide.size) and bool(np.isnan(wide.max()))


def _narrow(out: np.ndarray, wide: np.ndarray, *, nan_bf16: int) -> None:
    """`out` (F16 or BF16) = `wide` (F32 or F64) rounded to nearest even, with torch's NaN patterns."""
    _convert(out, wide)
    if not _has_nan(wide):
        return
    nan = np.flatnonzero(np.isnan(wide))
    bits = out.view(np.uint16)
    if out.dtype == _FLOAT["BF16"]:
        bits[nan] = nan_bf16
        return
    f32 = wide[nan].astype(np.float32).view(np.uint32)
    bits[nan] = ((f32 >> 16) & 0x8000) | 0x7E00 | ((f32 >> 13) & 0x3FF)
