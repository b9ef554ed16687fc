"""Transposing copy benchmark (issue 12): one [E, R, C] fp32 tensor exported with its last two dims
swapped (a registry `Transpose`), against the same tensor exported as is; in-process, same shard file.

`tiles` (engine/runner.py `_tiles`): a gather slab's source lines are read as tiles (one pread per span)
and placed with one transposing numpy copy; `lines`: the previous path, one pread and one numpy copy per
source line (tiles disabled). Rounds alternate the order; outputs deleted between runs.

    python bench/bench_transpose.py --experts 16 --rows 1024 --cols 1024 --repeat 3
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from stagerd.contract.hub_plan import HubPlan, TensorView
from stagerd.contract.safetensors_format import DCP_SHARDING_INFO_KEY, SAVED_OFFSETS_KEY
from stagerd.engine import runner
from stagerd.engine.consolidate import consolidate_into


def write_shard(path: Path, shape: tuple[int, ...]) -> None:
    data = np.random.default_rng(0).standard_normal(shape, dtype=np.float32)
    info = json.dumps({"w": {SAVED_OFFSETS_KEY: [0] * len(shape)}})
    head = json.dumps(
        {"__metadata__": {DCP_SHARDING_INFO_KEY: info}, "w": {"dtype": "F32", "shape": list(shape),
         "data_offsets": [0, data.nbytes]}}
    ).encode()  # fmt: skip
    head += b" " * (-len(head) % 8)
    with open(path, "wb") as f:
        f.write(len(head).to_bytes(8, "little") + head)
        f.write(data.tobytes())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--rows", type=int, default=1024)
    ap.add_argument("--cols", type=int, default=1024)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    e, r, c = a.experts, a.rows, a.cols
    work = Path(tempfile.mkdtemp(prefix="bench-transpose-"))
    try:
        src = work / "shards"
        src.mkdir()
        write_shard(src / "shard-00001-model-00001-of-00001.safetensors", (e, r, c))
        t = HubPlan((TensorView("w", "w", (0, 0, 0), (e, r, c), (e, c, r), (e, r, c), (0, 2, 1)),))
        plain = HubPlan()
        orig = runner._tiles

        def lines(pieces, room):
            return ((pc, 1, 0, -1) for pc in pieces)

        cases = {"as is": (plain, orig), "transposed, tiles": (t, orig), "transposed, lines": (t, lines)}
        times: dict[str, list[float]] = {k: [] for k in cases}
        outs = {}
        for i in range(a.repeat):
            for name in list(cases) if i % 2 == 0 else list(cases)[::-1]:
                hub, tiles = cases[name]
                runner._tiles = tiles
                out = work / "out"
                shutil.rmtree(out, ignore_errors=True)
                out.mkdir()
                t0 = time.perf_counter()
                consolidate_into(src, out, views=hub, threads=a.threads)
                times[name].append(time.perf_counter() - t0)
                data = b"".join(p.read_bytes() for p in sorted(out.glob("*.safetensors")))
                outs[name] = data if "transposed" in name else b""
        runner._tiles = orig
        assert outs["transposed, tiles"] == outs["transposed, lines"]
        mb = e * r * c * 4 / 1e6
        for name, ts in times.items():
            each = ", ".join(f"{x:.2f}" for x in ts)
            print(f"{name:20s} {mb:.0f} MB: median {statistics.median(ts):.2f} s  ({each})")
    finally:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
