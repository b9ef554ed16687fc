"""A saved tensor's values, and how far two are apart in units of the last place: the merged exports'
comparisons with PEFT's `merge_and_unload()`."""

from __future__ import annotations

from typing import Any

import numpy as np


def values(entry: Any) -> np.ndarray:
    """(dtype name, shape, bytes) of an F32 or BF16 tensor as float64 values."""
    import ml_dtypes

    dt = {"F32": np.float32, "BF16": ml_dtypes.bfloat16}[entry[0]]
    return np.frombuffer(entry[2], dtype=dt).astype(np.float64).reshape(entry[1])


def ulps(got: Any, want: Any) -> float:
    """How far apart in units of the last place: of the largest value (F32), of each value (BF16)."""
    g, w = values(got), values(want)
    if got[0] == "F32":
        return float(np.abs(g - w).max() / (2.0**-23 * np.abs(w).max()))
    ulp = 2.0 ** (np.floor(np.log2(np.maximum(np.abs(w), 2.0**-126))) - 7)
    return float((np.abs(g - w) / ulp).max())
