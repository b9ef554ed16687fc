"""`bench_consolidate.py --bar`: casts in the order a daemon runs them, right after another export.

Each round deletes the last round's outputs, waits until the kernel has handed the freed memory back to
the host (`settle`: the daemon's steady state, where the last big free was seconds ago; `sync; sleep 1`
where the kernel has no `page_reporting`), then runs `stagerd consolidate --threads 2 --max-shard-size
1GB` as keep, then `--dtype bf16`, then `--dtype fp16`, each after `sync; sleep 1`, every output kept
until the round ends: each cast follows a big write, as in the daemon. With `--compare REPO`, every round
also runs the same chain with the code of another checkout (order alternating), so before and after are
paired in one run. Prints wall, CPU and peak RSS per export, and each cast over keep paired by round.

    python bench/bench_consolidate.py --bar --shards bench/data/fx/shards --repeat 5 [--compare DIR]
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

CHAIN = ("keep", "bf16", "fp16")


def settle() -> None:
    import memory_probes

    subprocess.run(["sync"], check=True)
    memory_probes.settle(without=1.0)


def run(repo: Path, src: Path, out: Path, dtype: str, threads: int) -> tuple[float, float, float, float]:
    """(wall s, user s, system s, peak RSS MiB) of one `stagerd consolidate` process."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("STAGERD_")}
    env["PYTHONPATH"] = str(repo)
    cmd = [sys.executable, "-m", "stagerd.cli", "consolidate", str(src), str(out), "--threads", str(threads)]
    cmd += ["--max-shard-size", "1GB"] + (["--dtype", dtype] if dtype != "keep" else [])
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=repo)
    _, status, u = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    if os.waitstatus_to_exitcode(status):
        raise SystemExit(f"failed: {' '.join(cmd)}")
    return wall, u.ru_utime, u.ru_stime, u.ru_maxrss / 1024


def bar(src: Path, work: Path, repeat: int, threads: int, here: Path, compare: Path | None) -> None:
    src, work = src.resolve(), work.resolve()
    repos = {"after": here} if compare is None else {"before": compare.resolve(), "after": here}
    got: dict[str, dict[str, list[tuple[float, float, float, float]]]] = {
        r: {c: [] for c in CHAIN} for r in repos
    }
    loads = []
    outs = [work / f"bar-{c}" for c in CHAIN]
    for rnd in range(repeat):
        for name in list(repos) if rnd % 2 == 0 else list(repos)[::-1]:
            for o in outs:
                shutil.rmtree(o, ignore_errors=True)
            settle()
            for c, o in zip(CHAIN, outs, strict=True):
                if c != "keep":
                    subprocess.run(["sync"], check=True)
                    time.sleep(1)
                got[name][c].append(run(repos[name], src, o, c, threads))
            loads.append(os.getloadavg()[0])
            line = ", ".join(f"{c} {got[name][c][-1][0]:.2f} s" for c in CHAIN)
            print(f"round {rnd + 1} {name}: {line} (load {loads[-1]:.1f})", flush=True)
    for o in outs:
        shutil.rmtree(o, ignore_errors=True)
    print(
        f"\n{repeat} rounds, each cast right after keep (outputs kept), {threads} threads, "
        f"load average {min(loads):.1f}-{max(loads):.1f}\n"
    )
    print(
        "| code | export | wall s, median (min-max) | user s | sys s | peak RSS MiB "
        "| / keep, paired (min-max) |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, runs in got.items():
        for c in CHAIN:
            w = [r[0] for r in runs[c]]
            ratio = sorted(x / k[0] for x, k in zip(w, runs["keep"], strict=True))
            paired = (
                f"{statistics.median(ratio):.2f}x ({ratio[0]:.2f}-{ratio[-1]:.2f})" if c != "keep" else ""
            )
            print(
                f"| {name} | {c} | {statistics.median(w):.2f} ({min(w):.2f}-{max(w):.2f}) "
                f"| {statistics.median(r[1] for r in runs[c]):.2f} "
                f"| {statistics.median(r[2] for r in runs[c]):.2f} "
                f"| {max(r[3] for r in runs[c]):.0f} | {paired} |"
            )
