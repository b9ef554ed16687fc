"""`stagerd verify` on an export of many tiny tensors: peak RSS and time, this checkout against another.

Writes a synthetic DCP checkpoint (2 ranks, N F32 tensors of [4, 8], three in four split on dim 0 and every
fourth on dim 1, DCP_SHARDING_INFO as HuggingFaceStorageWriter writes it; no torch), exports it once with
this checkout's `stagerd consolidate` (one `model.safetensors`, and a 4-file export with its index), then
runs `stagerd verify EXPORT` and `stagerd verify EXPORT --against SRC` each in its own process (peak RSS
from wait4). With `--compare OTHER` (another checkout, e.g. `git worktree add /tmp/old main`), every
round runs OTHER's verify right before this checkout's, on the same files: paired before / after figures.
`--shards DIR` takes a checkpoint made earlier instead (`bench_consolidate.py --many-tensors N --keep`'s
real gloo save), and also times the one-file export itself (`consolidate`), the same plan's other user.

    python bench/bench_verify.py --tensors 100000 --repeat 3 --compare /tmp/old
    python bench/bench_verify.py --shards bench/data/many-100000/shards --repeat 5 --compare /tmp/old
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def write_source(src: Path, n: int) -> None:
    from tests.engine.test_plan_memory import synthetic_header_bytes

    src.mkdir(parents=True)
    for rank in range(2):
        head = synthetic_header_bytes(rank, n)
        data = bytes(range(256)) * (n * 64 // 256) + bytes(n * 64 % 256)
        (src / f"shard-{rank + 1:05d}-model-00001-of-00001.safetensors").write_bytes(head + data)


def timed(cmd: list[str], pythonpath: Path) -> tuple[float, float, float]:
    """(wall seconds, peak RSS MiB, CPU seconds: user + system) of a child process running `cmd` with
    `pythonpath` first. CPU seconds hold still on a shared machine, where wall time follows the load."""
    env = {**os.environ, "PYTHONPATH": str(pythonpath)}
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=pythonpath
    )
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"failed ({pythonpath}): {' '.join(cmd)}")
    return wall, usage.ru_maxrss / 1024, usage.ru_utime + usage.ru_stime


def spread(xs: list[float], digits: int) -> str:
    return f"{statistics.median(xs):.{digits}f} | {min(xs):.{digits}f} | {max(xs):.{digits}f}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tensors", type=int, default=100_000)
    ap.add_argument("--repeat", type=int, default=3, help="interleaved rounds (median reported)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--compare", type=Path, help="another checkout, run first in every round")
    ap.add_argument("--work", type=Path, help="where the files go (default: a temp dir, removed)")
    ap.add_argument("--shards", type=Path, help="an existing DCP checkpoint instead of synthetic shards")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="stagerd-bench-verify-", dir=args.work))
    try:
        src = work / "src"
        if args.shards:
            src = args.shards.resolve()
        else:
            # In a child: a forked child's peak RSS starts at its parent's, so the parent must stay small.
            subprocess.run([sys.executable, __file__, "--generate", str(src), str(args.tensors)], check=True)
        stagerd = [sys.executable, "-m", "stagerd.cli"]
        exports = {"1 file": work / "one", "4 files": work / "four"}

        def export(out: Path, *more: str) -> None:
            cmd = [*stagerd, "consolidate", str(src), str(out), *more]
            subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

        export(exports["1 file"])
        size = sum(f.stat().st_size for f in exports["1 file"].glob("*.safetensors"))
        export(exports["4 files"], "--max-shard-size", str(size // 4 + 1))
        trees = {"this": ROOT} | ({"other": args.compare.resolve()} if args.compare else {})
        cases = {}
        if args.shards:
            cases["consolidate (1 file)"] = [*stagerd, "consolidate", str(src), str(work / "again")]
        for what, out in exports.items():
            plain = [*stagerd, "verify", str(out), "--threads", str(args.threads)]
            cases[f"verify ({what})"] = plain
            cases[f"verify --against ({what})"] = [*plain, "--against", str(src)]
        found: dict[tuple[str, str], list[tuple[float, float, float]]] = {}
        load = [os.getloadavg()[0]]
        for rnd in range(args.repeat):
            for case, cmd in cases.items():
                for tree in reversed(trees):  # the other checkout first: "this" runs right after it
                    shutil.rmtree(work / "again", ignore_errors=True)
                    got = timed(cmd, trees[tree])
                    found.setdefault((case, tree), []).append(got)
                    load.append(os.getloadavg()[0])
                    print(
                        f"round {rnd + 1} {case:28s} {tree:5s} {got[0]:6.2f} s {got[1]:6.0f} MiB"
                        f" {got[2]:6.2f} s CPU, load {load[-1]:.1f}",
                        flush=True,
                    )
        what = src if args.shards else f"{args.tensors} tensors"
        print(f"\n{what}, {args.repeat} interleaved rounds, {args.threads} threads")
        head = (
            "| case | checkout | median s | min s | max s | peak RSS MiB, median | min | max"
            " | CPU s, median | min | max |"
        )
        print(f"\n{head}\n|---|---|---|---|---|---|---|---|---|---|---|")
        for (case, tree), runs in found.items():
            walls, peaks, cpus = [g[0] for g in runs], [g[1] for g in runs], [g[2] for g in runs]
            print(f"| {case} | {tree} | {spread(walls, 2)} | {spread(peaks, 0)} | {spread(cpus, 2)} |")
        if args.compare:
            print(
                "\n| case | time this/other, median | min | max | RSS this/other, median"
                " | CPU this/other, median |"
            )
            print("|---|---|---|---|---|---|")
            for case in cases:
                this, other = found[(case, "this")], found[(case, "other")]
                t = sorted(a[0] / b[0] for a, b in zip(this, other, strict=True))
                m = statistics.median(a[1] / b[1] for a, b in zip(this, other, strict=True))
                c = statistics.median(a[2] / b[2] for a, b in zip(this, other, strict=True))
                print(
                    f"| {case} | {statistics.median(t):.2f}x | {t[0]:.2f}x | {t[-1]:.2f}x | {m:.2f}x"
                    f" | {c:.2f}x |"
                )
        print(f"\nload average {min(load):.1f}-{max(load):.1f} during the runs (a shared machine)")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--generate"]:
        write_source(Path(sys.argv[2]), int(sys.argv[3]))
    else:
        main()
