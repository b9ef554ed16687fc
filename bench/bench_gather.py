"""Transposes and strided gathers against a plain copy of the same bytes: one [E, R, C] tensor exported
in-process (`consolidate_into`: planned, written, fsynced), laid out four ways on disk:

- `as is`: one shard holding the tensor whole (the plain copy: `copy_file_range` runs);
- `transposed`: the same shard, exported with its last two dims swapped (a registry `Transpose`: strided
  blocks, read and placed tile-wise, `engine/strided.py`);
- `Shard(2)`: four shards of C/4 columns each (every row gathered from four places);
- `2-D blocks`: four shards of [E, R/2, C/2] (a 2-D mesh's blocks).

Rounds interleave the cases (order reversed every other round); each output is deleted before the next
run. Prints a ready-to-paste table: wall and CPU (user + system) seconds, medians and min-max, and each
case over `as is` paired by round.

    python bench/bench_gather.py --experts 64 --rows 1024 --cols 1024 --repeat 5
    python bench/bench_gather.py --experts 1 --rows 8192 --cols 8192 --repeat 5 --dtype BF16
    python bench/bench_gather.py ... --repo /path/to/other/checkout   # the same with other code
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

# `--repo DIR` (read before the imports below): another checkout's engine, for a before/after pair.
sys.path.insert(
    0,
    str(
        Path(
            sys.argv[sys.argv.index("--repo") + 1] if "--repo" in sys.argv else __file__ + "/../.."
        ).resolve()
    ),
)

from stagerd.contract.hub_plan import HubPlan, TensorView
from stagerd.contract.safetensors_format import DCP_SHARDING_INFO_KEY, SAVED_OFFSETS_KEY
from stagerd.engine.consolidate import consolidate_into


def write_shard(path: Path, block: np.ndarray, at: tuple[int, ...]) -> None:
    info = json.dumps({"w": {SAVED_OFFSETS_KEY: list(at)}})
    head = json.dumps(
        {"__metadata__": {DCP_SHARDING_INFO_KEY: info}, "w": {"dtype": "F32", "shape": list(block.shape),
         "data_offsets": [0, block.nbytes]}}
    ).encode()  # fmt: skip
    head += b" " * (-len(head) % 8)
    with open(path, "wb") as f:
        f.write(len(head).to_bytes(8, "little") + head)
        f.write(np.ascontiguousarray(block).tobytes())


def layouts(work: Path, e: int, r: int, c: int) -> dict[str, tuple[Path, HubPlan]]:
    full = np.random.default_rng(0).standard_normal((e, r, c), dtype=np.float32)
    cases: dict[str, list[tuple[np.ndarray, tuple[int, ...]]]] = {
        "as is": [(full, (0, 0, 0))],
        "Shard(2)": [(full[:, :, k * c // 4 : (k + 1) * c // 4], (0, 0, k * c // 4)) for k in range(4)],
        "2-D blocks": [
            (
                full[:, i * r // 2 : (i + 1) * r // 2, j * c // 2 : (j + 1) * c // 2],
                (0, i * r // 2, j * c // 2),
            )
            for i in range(2)
            for j in range(2)
        ],
    }
    out: dict[str, tuple[Path, HubPlan]] = {}
    for name, blocks in cases.items():
        d = work / name.replace(" ", "_").replace("(", "").replace(")", "")
        d.mkdir()
        for k, (block, at) in enumerate(blocks):
            write_shard(d / f"shard-{k + 1:05d}-model-00001-of-00001.safetensors", block, at)
        out[name] = (d, HubPlan())
    if e == 1:  # a plain 2-D matrix: the view's reshape names only the dims longer than one
        t = TensorView("w", "w", (0, 0, 0), (1, r, c), (1, c, r), (r, c), (1, 0))
    else:
        t = TensorView("w", "w", (0, 0, 0), (e, r, c), (e, c, r), (e, r, c), (0, 2, 1))
    out["transposed"] = (out["as is"][0], HubPlan((t,)))
    return {k: out[k] for k in ("as is", "transposed", "Shard(2)", "2-D blocks")}


def cpu() -> float:
    u = resource.getrusage(resource.RUSAGE_SELF)
    return u.ru_utime + u.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--rows", type=int, default=1024)
    ap.add_argument("--cols", type=int, default=1024)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default=None, help="cast every case to this dtype (BF16, F16)")
    ap.add_argument("--dir", type=Path, default=Path(__file__).resolve().parent / "data")
    ap.add_argument("--repo", type=Path, help="run another checkout's engine (before / after)")
    a = ap.parse_args()
    a.dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench-gather-", dir=a.dir))
    try:
        cases = layouts(work, a.experts, a.rows, a.cols)
        walls: dict[str, list[float]] = {k: [] for k in cases}
        cpus: dict[str, list[float]] = {k: [] for k in cases}
        loads = []
        out = work / "out"
        for i in range(a.repeat):
            for name in list(cases) if i % 2 == 0 else list(cases)[::-1]:
                src, hub = cases[name]
                shutil.rmtree(out, ignore_errors=True)
                out.mkdir()
                os.sync()
                t0, c0 = time.perf_counter(), cpu()
                consolidate_into(src, out, views=hub, threads=a.threads, dtype=a.dtype)
                walls[name].append(time.perf_counter() - t0)
                cpus[name].append(cpu() - c0)
                loads.append(os.getloadavg()[0])
                print(
                    f"round {i + 1} {name:12s} {walls[name][-1]:6.2f} s  CPU {cpus[name][-1]:5.2f} s",
                    flush=True,
                )
        mb = a.experts * a.rows * a.cols * 4 / 1e6
        print(
            f"\n[{a.experts}, {a.rows}, {a.cols}] fp32 ({mb:.0f} MB){f' -> {a.dtype}' if a.dtype else ''}, "
            f"{a.threads} threads, {a.repeat} interleaved rounds, {os.cpu_count()} cores, "
            f"load average {min(loads):.1f}-{max(loads):.1f}\n"
        )
        print(
            "| layout | wall s, median (min-max) | CPU s, median "
            "| / as is, wall, paired (range) | / as is, CPU |"
        )
        print("|---|---|---|---|---|")
        for name in cases:
            w, c = walls[name], cpus[name]
            rw = sorted(x / y for x, y in zip(w, walls["as is"], strict=True))
            rc = statistics.median(x / y for x, y in zip(c, cpus["as is"], strict=True))
            print(
                f"| {name} | {statistics.median(w):.2f} ({min(w):.2f}-{max(w):.2f}) "
                f"| {statistics.median(c):.2f} "
                f"| {statistics.median(rw):.2f}x ({rw[0]:.2f}-{rw[-1]:.2f}) | {rc:.2f}x |"
            )
    finally:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
