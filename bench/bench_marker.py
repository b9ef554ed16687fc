"""Reading a commit marker of many tensors: its bytes, the reader's peak memory and its time, paired.

The marker is `tests/contract/test_marker_memory.synthetic_marker` (a MoE model saved under a wrapper's
prefix: every staged key renamed, fused experts split per expert, tied embeddings, the save order naming
every output), written by this checkout and in the older form (`old_form`: indented, an object per tensor
and per view). Each read runs in its own process: `commit_marker.read_marker` once, timed, with the peak
RSS it added over the process before it (ru_maxrss after minus RSS before) and, in a second read,
tracemalloc's peak. With `--compare OTHER` (another checkout, e.g. `git worktree add /tmp/old main`),
every round reads the old form with OTHER's reader right before this checkout reads both forms: paired
before / after.

    python bench/bench_marker.py --outputs 10000 100000 --repeat 3 --compare /tmp/old
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

CHILD = """
import gc, json, resource, sys, time, tracemalloc
try:
    from stagerd.contract.commit_marker import read_marker
except ImportError:  # --compare with a checkout from before the marker had a module of its own
    from stagerd.contract.layout import read_marker
step = sys.argv[1]
gc.collect()
rss = int(open("/proc/self/statm").read().split()[1]) * resource.getpagesize()
t = time.perf_counter()
m = read_marker(step)
t = time.perf_counter() - t
peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss
del m
gc.collect()
tracemalloc.start()
m = read_marker(step)
peak = tracemalloc.get_traced_memory()[1]
print(json.dumps({"s": t, "rss": peak_rss, "traced": peak}))
"""


def write_steps(work: Path, n: int) -> dict[str, Path]:
    from stagerd.contract import commit_marker, layout
    from tests.contract.test_marker_memory import old_form, synthetic_marker

    marker = synthetic_marker(n)
    steps = {"new form": work / "new" / "step-00000007", "old form": work / "old" / "step-00000007"}
    for d in steps.values():
        d.mkdir(parents=True)
    commit_marker.write_marker(steps["new form"], marker)
    (steps["old form"] / layout.MARKER_NAME).write_bytes(old_form(marker))
    return steps


def read(tree: Path, step: Path) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run([sys.executable, "-c", CHILD, str(step)], env=env, cwd=tree, check=True, stdout=-1)
    return json.loads(out.stdout)


def spread(xs: list[float], digits: int = 0) -> str:
    return f"{statistics.median(xs):.{digits}f} ({min(xs):.{digits}f}-{max(xs):.{digits}f})"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--outputs", type=int, nargs="+", default=[10_000, 100_000])
    ap.add_argument("--repeat", type=int, default=3, help="interleaved rounds (median reported)")
    ap.add_argument("--compare", type=Path, help="another checkout: its reader on the old form, first")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="stagerd-bench-marker-"))
    rows = []
    try:
        for n in args.outputs:
            # In a child: the parent stays small, and its builder's objects are not the children's
            subprocess.run([sys.executable, __file__, "--generate", str(work / str(n)), str(n)], check=True)
            steps = {k: work / str(n) / k.split()[0] / "step-00000007" for k in ("old form", "new form")}
            cases = (
                {"before: old reader, old form": (args.compare, steps["old form"])} if args.compare else {}
            )
            cases |= {"this reader, old form": (ROOT, steps["old form"])}
            cases |= {"this reader, new form": (ROOT, steps["new form"])}
            found: dict[str, list[dict[str, float]]] = {c: [] for c in cases}
            for rnd in range(args.repeat):
                for case, (tree, step) in cases.items():
                    got = read(tree.resolve(), step)
                    found[case].append(got)
                    print(
                        f"{n} round {rnd + 1} {case:30s} {got['s']:.3f} s {got['rss'] / 2**20:7.1f} MiB",
                        flush=True,
                    )
            base = found[next(iter(cases))]
            for case, (_, step) in cases.items():
                runs = found[case]
                paired = [r["s"] / b["s"] for r, b in zip(runs, base, strict=True)]
                size = (step / "stagerd.commit.json").stat().st_size
                rss, traced = ([r[k] / 2**20 for r in runs] for k in ("rss", "traced"))
                rows.append(
                    f"| {n:,} | {case} | {size / 2**20:.1f} MiB ({size / n:.0f} B/output) | "
                    f"{spread(rss, 1)} | {spread(traced, 1)} | {spread([r['s'] * 1000 for r in runs])} | "
                    f"{spread(paired, 2)} |"
                )
        print(f"\n{args.repeat} interleaved rounds; each read in its own process; median (min-max)\n")
        print(
            "| outputs | reader, marker | marker bytes | read peak RSS added, MiB | tracemalloc peak, MiB ",
            end="",
        )
        print("| read ms | time / the first row's, paired |")
        print("|---|---|---|---|---|---|---|")
        print("\n".join(rows))
        print(f"\nload average {os.getloadavg()[0]:.1f} at the end (a shared machine)")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--generate"]:
        write_steps(Path(sys.argv[2]), int(sys.argv[3]))
    else:
        main()
