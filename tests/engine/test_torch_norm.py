"""DoRA's norms (`engine/torch_norm.py`) equal torch's `linalg.norm(x, dim=1)` bit for bit: a contiguous
row in each dtype, with and without a tail after the last whole vector, and a strided column fed a row
block at a time; under each CPU capability torch dispatches on this machine."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch

from stagerd.engine import torch_norm

SIZES = (1, 7, 8, 9, 16, 17, 100, 1000, 4099)
DTYPES = {
    "f32": (torch.float32, np.dtype(np.float32)),
    "f64": (torch.float64, np.dtype(np.float64)),
    "bf16": (torch.bfloat16, np.dtype(ml_dtypes.bfloat16)),
    "f16": (torch.float16, np.dtype(np.float16)),
}


def _values(rows: int, cols: int, dt: torch.dtype, seed: int) -> torch.Tensor:
    """Rows of one scale each, over a few decades, so that sums round at every step."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.logspace(-2, 2, rows, dtype=torch.float64)[:, None]
    return (torch.randn(rows, cols, generator=g, dtype=torch.float64) * scale).to(dt)


def _held(t: torch.Tensor) -> np.ndarray:
    """The values as the merge holds them: float64 for float64, float32 otherwise."""
    return t.double().numpy() if t.dtype == torch.float64 else t.float().numpy()


def _bits(x: np.ndarray, dt: np.dtype) -> np.ndarray:
    return x.astype(dt).view(f"u{dt.itemsize}")


@pytest.mark.parametrize("name", sorted(DTYPES))
def test_row_norms_are_torchs(name):
    tdt, dt = DTYPES[name]
    # a float64 row's tail torch fuses is added rounded here (torch_norm's docstring): rows without one
    sizes = [n for n in SIZES if name != "f64" or n % 4 == 0 or not torch_norm.fused_tail()]
    for seed, size in enumerate(sizes):
        t = _values(64, size, tdt, seed)
        want = torch.linalg.norm(t, dim=1)
        s = _held(t)
        got = torch_norm.rows(s, dt)
        assert got.dtype == s.dtype
        assert np.array_equal(_bits(got, dt), _bits(_held(want), dt)), (name, size)


@pytest.mark.parametrize("name", sorted(DTYPES))
def test_column_norms_fed_by_row_blocks_are_torchs(name):
    """W is in x out (Conv1D, an Embedding's transpose): torch reduces over the strided dim of W.T."""
    tdt, dt = DTYPES[name]
    for seed, size in enumerate(SIZES):
        w = _values(size, 37, tdt, seed)  # in x out, as stored: torch reduces over W.T's strided dim
        want = torch.linalg.norm(w.T, dim=1)
        cols = torch_norm.Columns(37, dt)
        s = _held(w)
        for lo in range(0, size, 5):  # row blocks of 5
            cols.add(s[lo : lo + 5])
        got = cols.norms(s.dtype)
        assert np.array_equal(_bits(got, dt), _bits(_held(want), dt)), (name, size)


def test_a_row_that_torch_sums_otherwise_is_not_equal():
    """The test can fail: numpy's own sum of the same squares differs from torch's in some rows."""
    t = _values(64, 4099, torch.float32, 0)
    s = _held(t)
    numpy_own = np.sqrt(np.square(s).sum(axis=1, dtype=np.float32))
    assert not np.array_equal(numpy_own, _held(torch.linalg.norm(t, dim=1)))


@pytest.mark.parametrize("capability", ["avx2", "default"])
def test_each_cpu_capability_sums_as_the_kernel_says(capability):
    """torch picks its kernels by the CPU's capability (or ATEN_CPU_CAPABILITY): the same bits in each."""
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability}
    # The two tests above, every dtype, in a process whose torch reads the variable at import: a plain
    # interpreter, not a whole pytest session (its plugins and conftest cost about a second more).
    code = (
        "from tests.engine import test_torch_norm as t\n"
        "for name in sorted(t.DTYPES):\n"
        "    t.test_row_norms_are_torchs(name)\n"
        "    t.test_column_norms_fed_by_row_blocks_are_torchs(name)\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        cwd=Path(__file__).resolve().parents[2],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
