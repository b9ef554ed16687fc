# The compiled torch-order sums (_torchsum.c): C-contiguous float32 buffers of the dims given, checked; each
# rank step an fmaf (`fused`) or a rounded product added; GIL released.
import numpy as np

VECTOR: bool  # whether the AVX2 + FMA loops run (x86-64); the bits are the same either way

def block(
    left: np.ndarray, right: np.ndarray, out: np.ndarray, m: int, r: int, n: int, fused: bool, /
) -> None: ...
def rows(x: np.ndarray, y: np.ndarray, out: np.ndarray, m: int, r: int, fused: bool, /) -> None: ...
