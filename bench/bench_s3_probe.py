"""What the probe of an S3 store's conditional requests (`stagerd/sinks/s3/conditions.py`) costs a sink's
first step: paired, interleaved rounds on one moto server, the same export each time.

Per round, in an order that alternates: a fresh sink publishes step 1 with the probe inside the timed
publish (as a daemon's first step), and a fresh sink whose probe ran before the clock (as every later
step). Also the probe alone on a fresh sink whose client is built. Every run starts from an empty bucket.

    python bench/bench_s3_probe.py                  # 20 files of 1 MB, 9 rounds
    python bench/bench_s3_probe.py --small-files 1 --rounds 15
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_publish_s3 import (
    BUCKET,
    boto_client,
    empty_bucket,
    make_small_export,
    open_stagerd,
    start_moto,
    warm,
)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small-files", type=int, default=20, help="files of 1 MB in the step")
    ap.add_argument("--rounds", type=int, default=9, help="paired rounds (at least 3 for a spread)")
    args = ap.parse_args()
    load0 = os.getloadavg()[0]
    proc, endpoint = start_moto()
    part, conc = 16 << 20, 8
    names = ("first step, probe inside", "step, probe before", "probe alone")
    times: dict[str, list[float]] = {n: [] for n in names}
    try:
        client = boto_client(endpoint, 4)
        client.create_bucket(Bucket=BUCKET)
        with tempfile.TemporaryDirectory() as tmp:
            export = make_small_export(Path(tmp) / "export", args.small_files)
            for r in range(args.rounds):
                order = [True, False] if r % 2 == 0 else [False, True]
                for probe_inside in order:
                    warm(export)
                    sink = open_stagerd(endpoint, "run", part, conc)
                    b = sink._backend
                    if not probe_inside:
                        t = time.perf_counter()
                        b._run(b.conditions, tidied=True)  # type: ignore[attr-defined]
                        times["probe alone"].append(time.perf_counter() - t)
                    t = time.perf_counter()
                    sink.publish(export, 1)
                    key = "first step, probe inside" if probe_inside else "step, probe before"
                    times[key].append(time.perf_counter() - t)
                    sink.close()
                    empty_bucket(client)
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(30)
    base = statistics.median(times["step, probe before"])
    print(f"\n{args.small_files} x 1 MB, {args.rounds} paired rounds, moto, {os.cpu_count()} CPUs")
    print("| run | median ms | min-max ms | vs probe before |")
    print("|---|---|---|---|")
    for name, ts in times.items():
        med = statistics.median(ts)
        ratio = f"{med / base:.2f}x" if name != "probe alone" else "-"
        print(f"| {name} | {med * 1e3:.1f} | {min(ts) * 1e3:.1f}-{max(ts) * 1e3:.1f} | {ratio} |")
    print(f"load average {load0:.2f} at start, {os.getloadavg()[0]:.2f} at end")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
