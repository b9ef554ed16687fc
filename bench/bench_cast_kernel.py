"""Cast kernel speed in isolation: GB/s per direction, one thread, compiled F16C kernel against numpy.

Each direction casts N normally distributed values (no NaNs, as in real weights) from one warm buffer into
another, `--calls` times; the figure is source bytes per second, median and range over the calls. A plain
copy of the F32 buffer (numpy) is the ceiling. STAGERD_NO_HALFCAST is not needed: both paths run here.

    python bench/bench_cast_kernel.py --mib 8 --calls 40
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from stagerd.engine import cast

WIDTH = {"F16": 2, "BF16": 2, "F32": 4, "F64": 8}


def source(dtype: str, n: int) -> memoryview:
    values = bytearray(np.random.default_rng(0).standard_normal(n).astype(np.float32).tobytes())
    if dtype == "F32":
        return memoryview(values)
    buf = bytearray(n * WIDTH[dtype])
    cast.cast_into(memoryview(values), memoryview(buf), "F32", dtype)
    return memoryview(buf)


def rate(fn, nbytes: int, calls: int) -> list[float]:
    fn()  # first touch of the destination pages
    out = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        out.append(nbytes / (time.perf_counter() - t0) / 1e9)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=float, default=8.0, help="F32-equivalent MiB per call")
    ap.add_argument("--calls", type=int, default=40)
    args = ap.parse_args()
    n = int(args.mib * 2**20) // 4
    compiled = dict(cast._COMPILED)
    print(f"{n} elements per call, {args.calls} calls, one thread, load average {os.getloadavg()[0]:.1f}")
    print("| direction | kernel | GB/s of source, median | min | max |")
    print("|---|---|---|---|---|")
    f32 = source("F32", n)
    copy_dst = bytearray(len(f32))
    got = rate(lambda: memoryview(copy_dst).__setitem__(slice(None), f32), len(f32), args.calls)
    print(f"| F32 copy | memcpy | {statistics.median(got):.1f} | {min(got):.1f} | {max(got):.1f} |")
    for src, dst in itertools.permutations(("F32", "F16", "BF16"), 2):
        s, d = source(src, n), memoryview(bytearray(n * WIDTH[dst]))
        for kernel in ("compiled", "numpy"):
            if kernel == "compiled" and (src, dst) not in compiled:
                continue
            cast._COMPILED = compiled if kernel == "compiled" else {}
            got = rate(lambda s=s, d=d, a=src, b=dst: cast.cast_into(s, d, a, b), len(s), args.calls)
            print(
                f"| {src} -> {dst} | {kernel} | {statistics.median(got):.1f} | {min(got):.1f} "
                f"| {max(got):.1f} |"
            )
    cast._COMPILED = compiled


if __name__ == "__main__":
    main()
