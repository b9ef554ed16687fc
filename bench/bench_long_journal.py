"""A long run's journal: `stagerd watch --once` and `stagerd status` on a ROOT whose journal holds N
retired steps (a lane per sink each) and one live published step, this checkout against another.

A daemon saving every few minutes for months retires tens of thousands of steps. Each tool runs in its
own process (wall time and peak RSS from `wait4`), the two checkouts alternating round by round on the
same journal, so the ratios are paired.

    python bench/bench_long_journal.py --steps 100000 --compare /path/to/main/checkout --repeat 3
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

REPO = Path(__file__).resolve().parent.parent


def make_root(root: Path, n: int, sinks: list[str], repo: Path) -> None:
    """The journal, set up by `repo`'s code (its schema, its indexes), in a child process."""
    code = f"import sys; sys.path.insert(0, {str(REPO / 'bench')!r}); import bench_long_journal as b; "
    code += f"b.fill({str(root)!r}, {n}, {sinks!r})"
    env = {**os.environ, "PYTHONPATH": str(repo)}
    subprocess.run([sys.executable, "-c", code], env=env, cwd=repo, check=True)


def fill(root: str, n: int, sinks: list[str]) -> None:
    from stagerd.contract import layout
    from stagerd.daemon.journal import Journal

    j = Journal.open(root)
    now = time.time()
    with j._tx() as c:
        c.executemany(
            "INSERT INTO steps (step, path, state, marker_mtime, found_at, updated) "
            "VALUES (?, ?, ?, ?, ?, ?)",
            [
                (s, layout.step_dir_name(s), "retired" if s < n else "published", now, now, now)
                for s in range(n + 1)
            ],
        )
        c.executemany(
            "INSERT INTO lanes (step, sink, state, updated) VALUES (?, ?, 'published', ?)",
            [(s, k, now) for s in range(n + 1) for k in sinks],
        )
    j.close()


# What an idle daemon's schedule pass asks the journal once a second (two sinks), 100 times; the journal
# is opened (and, by this checkout, set up) first, outside the timing.
IDLE_PASSES = """
import sys, time
from stagerd.daemon.journal import Journal
root, sinks = sys.argv[1], sys.argv[2:]
j = Journal.open(root)
now = time.time()
t0 = time.perf_counter()
for _ in range(100):
    j.next_export(now, ())
    for s in sinks:
        j.next_publish(s, now, ())
    j.next_retry_time()
"""


def timed(cmd: list[str], repo: Path) -> tuple[float, float]:
    """(wall seconds, peak RSS MiB) of one child process running `repo`'s code."""
    env = {**os.environ, "PYTHONPATH": str(repo)}
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, cwd=repo, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"failed ({repo}): {' '.join(cmd)}")
    return time.perf_counter() - t0, usage.ru_maxrss / 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=100_000, help="retired steps in the journal")
    ap.add_argument("--compare", type=Path, help="another checkout (e.g. main), run in the same rounds")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="stagerd-longjournal-"))
    try:
        sink_a, sink_b = work / "a", work / "b"
        sinks = [f"file://{sink_a}", f"file://{sink_b}"]
        repos = {"this": REPO, **({"other": args.compare.resolve()} if args.compare else {})}
        roots = {name: work / f"root-{name}" for name in repos}  # a checkout may add indexes to its own
        for d in (sink_a, sink_b, *roots.values()):
            d.mkdir()
        for name, root in roots.items():
            make_root(root, args.steps, sinks, repos[name])
        py = [sys.executable, "-m", "stagerd.cli"]

        def tools(root: Path) -> dict[str, list[str]]:
            return {
                "watch --once": [
                    *py,
                    "watch",
                    str(root),
                    *(x for s in sinks for x in ("--sink", s)),
                    "--once",
                ],
                "status": [*py, "status", str(root)],
                "status --json": [*py, "status", str(root), "--json"],
                "idle schedule pass x100": [sys.executable, "-c", IDLE_PASSES, str(root), sinks[0], sinks[1]],
            }

        got: dict[tuple[str, str], list[tuple[float, float]]] = {}
        for rnd in range(args.repeat):
            order = list(repos.items()) if rnd % 2 == 0 else list(reversed(repos.items()))
            for tool in tools(work):
                for name, repo in order:
                    got.setdefault((tool, name), []).append(timed(tools(roots[name])[tool], repo))
        load = os.getloadavg()
        print(f"{args.steps:,} retired steps x {len(sinks)} sinks, {args.repeat} rounds, load {load[0]:.1f}")
        print("| tool | checkout | median s | min-max s | peak RSS MiB median | min-max |")
        print("|---|---|---|---|---|---|")
        for (tool, name), runs in got.items():
            s, m = [r[0] for r in runs], [r[1] for r in runs]
            print(
                f"| {tool} | {name} | {statistics.median(s):.2f} | {min(s):.2f}-{max(s):.2f} "
                f"| {statistics.median(m):.0f} | {min(m):.0f}-{max(m):.0f} |"
            )
        if args.compare:
            for tool in tools(work):
                this = statistics.median(r[0] for r in got[(tool, "this")])
                other = statistics.median(r[0] for r in got[(tool, "other")])
                print(f"{tool}: this / other time {this / other:.2f}x")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
