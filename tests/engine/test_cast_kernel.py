"""The cast kernel equals torch's `.to()` bit for bit: every 16-bit source pattern, millions of random F32
and F64 patterns, and the edge cases by hand (NaN payloads, +-inf, overflow, subnormals, ties). The F16
directions are checked twice: through the compiled F16C kernel and through the numpy fallback."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from stagerd.contract import dtypes
from stagerd.engine import cast
from stagerd.engine.cast import CAST_DTYPES, can_cast, cast_into

TORCH = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64}
BITS = {2: np.uint16, 4: np.uint32, 8: np.uint64}
SIGNED = {2: torch.int16, 4: torch.int32, 8: torch.int64}
INTS = {2: np.int16, 4: np.int32, 8: np.int64}
PAIRS = [(s, d) for s, d in itertools.permutations(TORCH, 2)]
HALF_PAIRS = [("F32", "F16"), ("F16", "F32"), ("BF16", "F16"), ("F16", "BF16")]  # the compiled directions


@pytest.fixture(params=["compiled", "numpy"])
def kernel(request, monkeypatch):
    """Each F16 direction through the compiled kernel, then through numpy (as without a C compiler)."""
    if request.param == "numpy":
        monkeypatch.setattr(cast, "_COMPILED", {})
    return request.param


# Hand-picked F32 patterns: NaNs (quiet, signalling, payloads that vanish when narrowed), infinities,
# the largest finite values, the overflow boundary of F16 and BF16, subnormals of all three, exact ties
# (even and odd) and just-above-tie values.
F32_EDGES = [
    0x00000000,
    0x80000000,
    0x7F800000,
    0xFF800000,
    0x7FC00000,
    0xFFC00000,
    0x7F800001,
    0xFF800001,
    0x7FBFFFFF,
    0x7FFFFFFF,
    0x7F810000,
    0x7F801000,
    0x7F802000,
    0xFFC00001,
    0x7F7FFFFF,
    0xFF7FFFFF,
    0x477FEFFF,
    0x477FF000,
    0x477FF001,
    0x477FFFFF,
    0x7F7F8000,
    0x7F7F7FFF,
    0x00000001,
    0x80000001,
    0x007FFFFF,
    0x00800000,
    0x33000000,
    0x33000001,
    0x337FFFFF,
    0x33800000,
    0x387FC000,
    0x387FE000,
    0x38800000,
    0x3F808000,
    0x3F818000,
    0x3F808001,
    0x3F800FFF,
    0x3F801000,
    0x3F803000,
    0x3F801001,
    0x00010000,
    0x00018000,
    0x00008000,
    0x80018000,
]


def torch_cast(bits: np.ndarray, src: str, dst: str) -> np.ndarray:
    width = dtypes.lookup(src).bits // 8
    t = torch.from_numpy(bits.astype(BITS[width]).view(INTS[width]))
    out = t.view(TORCH[src]).to(TORCH[dst])
    return out.view(SIGNED[dtypes.lookup(dst).bits // 8]).numpy().view(BITS[dtypes.lookup(dst).bits // 8])


def kernel_cast(bits: np.ndarray, src: str, dst: str) -> np.ndarray:
    out = bytearray(bits.size * dtypes.lookup(dst).bits // 8)
    cast_into(memoryview(bytearray(bits.tobytes())), memoryview(out), src, dst)
    return np.frombuffer(out, dtype=BITS[dtypes.lookup(dst).bits // 8])


def assert_same(bits: np.ndarray, src: str, dst: str) -> None:
    got, want = kernel_cast(bits, src, dst), torch_cast(bits, src, dst)
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, f"{src}->{dst}: {bad.size} differ, e.g. " + ", ".join(
        f"{int(bits[i]):#x}: got {int(got[i]):#x}, torch {int(want[i]):#x}" for i in bad[:5]
    )


def sources(src: str, rng: np.random.Generator) -> np.ndarray:
    if src in ("F16", "BF16"):
        return np.arange(1 << 16, dtype=np.uint16)  # every pattern
    if src == "F32":
        edges = np.array(F32_EDGES, dtype=np.uint32)
        return np.concatenate(
            [edges, rng.integers(0, 1 << 32, size=4_000_000, dtype=np.uint64).astype(np.uint32)]
        )
    # F64: random patterns, plus values near the F32/F16/BF16 ranges where double rounding shows.
    near = (rng.standard_normal(1_000_000) * np.exp2(rng.integers(-30, 20, size=1_000_000))).view(np.uint64)
    ties = np.array(
        [1 + 2**-8 + 2**-40, 1 + 2**-11 + 2**-40, 1 + 2**-24 + 2**-60, 65520.0, 65519.99, 2**-25],
        dtype=np.float64,
    ).view(np.uint64)
    nans = np.array(
        [0x7FF8000000000001, 0x7FF0000000000001, 0xFFF4000000000000, 0x7FF0000020000000], dtype=np.uint64
    )
    return np.concatenate([nans, ties, near, rng.integers(0, 1 << 64, size=1_000_000, dtype=np.uint64)])


@pytest.mark.parametrize(("src", "dst"), PAIRS, ids=[f"{s}->{d}" for s, d in PAIRS])
def test_kernel_equals_torch(src, dst, kernel):
    assert_same(sources(src, np.random.default_rng(15)), src, dst)


@pytest.mark.parametrize(("src", "dst"), PAIRS, ids=[f"{s}->{d}" for s, d in PAIRS])
def test_unaligned_lengths_and_empty(src, dst, kernel):
    """Lengths around the vector widths and the two-step block size, and nothing at all."""
    rng = np.random.default_rng(1)
    width = dtypes.lookup(src).bits // 8
    for n in (0, 1, 7, 17, (1 << 15) - 1, (1 << 15) + 3):
        bits = rng.integers(0, 1 << (8 * width) if width < 8 else 1 << 63, size=n, dtype=np.uint64).astype(
            BITS[width]
        )
        assert_same(bits, src, dst)


def test_the_compiled_kernel_is_in_use():
    """CI builds on x86-64 with gcc: a build that fell back to numpy (30x slower F16) fails here."""
    assert cast._halfcast is not None, "stagerd/engine/_halfcast.c was not built (no C compiler?)"
    assert cast._halfcast.F16C, "this CPU lacks AVX2 or F16C"
    assert set(cast._COMPILED) == set(HALF_PAIRS)


def test_the_switch_keeps_every_cast_in_numpy():
    """STAGERD_NO_HALFCAST=1 is how the benchmarks time the numpy kernel: it must leave no compiled path."""
    import os
    import subprocess
    import sys

    code = "from stagerd.engine import cast; print(len(cast._COMPILED))"
    env = {**os.environ, "STAGERD_NO_HALFCAST": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True, text=True)
    assert out.stdout.strip() == "0"


@pytest.mark.parametrize(("src", "dst"), HALF_PAIRS)
def test_compiled_kernel_ignores_flush_denormal(src, dst):
    """Another library may set MXCSR's DAZ and FTZ for a thread (torch.set_flush_denormal, -ffast-math):
    the only subnormals they touch are F32 ones, which are zero in F16 anyway, and VCVTPS2PH ignores FTZ."""
    bits = np.arange(1 << 16, dtype=np.uint16)
    if src == "F32":
        bits = np.concatenate([bits, bits.astype(np.uint32) << 8, np.array(F32_EDGES, np.uint32)])
    want = torch_cast(bits, src, dst)
    torch.set_flush_denormal(True)
    try:
        got = kernel_cast(bits, src, dst)
    finally:
        torch.set_flush_denormal(False)
    assert np.array_equal(got, want)


def test_every_castable_pair_has_a_kernel():
    castable = {d.name for d in dtypes.DTYPES.values() if d.castable}
    assert castable == CAST_DTYPES
    assert all(can_cast(s, d) for s, d in itertools.permutations(castable, 2))
    assert not can_cast("F32", "F8_E4M3") and not can_cast("I32", "F32")


def test_cast_never_imports_torch_into_a_fresh_interpreter():
    import subprocess
    import sys

    code = (
        "import sys, stagerd.engine.cast as c\n"
        "a = bytearray(8); b = bytearray(4)\n"
        "c.cast_into(memoryview(a), memoryview(b), 'F32', 'BF16')\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
