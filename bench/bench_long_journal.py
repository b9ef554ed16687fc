"""A long run's journal: `stagerd watch --once` and `stagerd status` on a ROOT whose journal holds N
retired steps (a lane per sink and the 11 events of its life each) and one live published step, this
checkout against another.

A daemon saving every few minutes for months retires tens of thousands of steps. Each tool runs in its
own process (wall time and peak RSS from `wait4`), the two checkouts alternating round by round on the
same journal, so the ratios are paired. Then each checkout runs `--life` more steps through the journal
API as a daemon does (found, exported, published on each sink, retired), on its own copy of the journal:
the journal's size on disk, the bytes its rows hold, and the time per step and per gauge refresh, as
they go, show what keeps growing with every step.

    python bench/bench_long_journal.py --steps 100000 --compare /path/to/main/checkout --repeat 3
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
        c.executemany(
            "INSERT INTO events (ts, step, sink, from_state, to_state, message) VALUES (?, ?, ?, ?, ?, ?)",
            [e for s in range(n + 1) for e in _life_events(s, sinks, now, retired=s < n)],
        )
    j.close()


def _life_events(step: int, sinks: list[str], now: float, *, retired: bool) -> list[tuple]:
    """The events a step's life through the daemon leaves (as `Journal` records them)."""
    out = [(now, step, None, None, "committed", None), (now, step, None, "committed", "exporting", None)]
    out.append((now, step, None, "exporting", "exported", None))
    out += [(now, step, k, None, "pending", None) for k in sinks]
    out += [(now, step, k, "pending", "publishing", None) for k in sinks]
    out += [(now, step, k, "publishing", "published", f"{k}/step-{step:08d}") for k in sinks]
    out.append((now, step, None, "exported", "published", None))
    if retired:
        out.append((now, step, None, "published", "retired", "retention: keep_last=3"))
    return out


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


# `--life` steps through the journal as a daemon moves them, retention keeping the newest 3, in 5 parts:
# after each, the journal file (with its WAL), the bytes its pages hold, and the cost per step and per
# gauge refresh (the `_refresh` queries, every `disk_check_seconds` and after each publish). One JSON line.
LIFE = """
import json, os, sys, time
from stagerd.daemon.journal import Journal
root, first, life, sinks = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]
j = Journal.open(root)
path = str(j.path)
def pragma(name):
    return j._conn.execute(f"PRAGMA {name}").fetchone()[0]
def size():
    used = (pragma("page_count") - pragma("freelist_count")) * pragma("page_size")
    wal = os.path.getsize(path + "-wal") if os.path.exists(path + "-wal") else 0
    return os.path.getsize(path) + wal, used
def gauges():
    t = time.perf_counter()
    for _ in range(10):
        j.counts(); j.lane_counts(); j.steps(include_retired=False)
    return (time.perf_counter() - t) / 10
def one(s):
    j.add_step(s, f"{root}/step-{s:08d}", 1.0, f"sha256:{s}")
    j.begin_export(s)
    j.finish_export(s, sinks, seconds=1, export_bytes=1, tensor_bytes=1, files=1, skipped=False)
    for k in sinks:
        j.begin_publish(s, k)
        j.finish_publish(s, k, sinks=sinks, seconds=1, bytes_total=1, bytes_uploaded=1,
                         location=f"{k}/step-{s:08d}", skipped=False)
    for old in sorted(r.step for r in j.steps(include_retired=False) if r.state == "published")[:-3]:
        j.retire(old, "retention: keep_last=3")
out = [dict(zip(("file", "used"), size()), steps=0, step_ms=None, gauges_ms=gauges() * 1e3)]
t0 = time.perf_counter()
j.retire(first - 1, "retention: keep_last=3")  # the journal's one live step: an older journal's first pruning
out[0]["first_ms"] = (time.perf_counter() - t0) * 1e3
s = first
for part in range(5):
    t0 = time.perf_counter()
    for _ in range(life // 5):
        one(s)
        s += 1
    ms = (time.perf_counter() - t0) / (life // 5) * 1e3
    out.append(dict(zip(("file", "used"), size()), steps=s - first, step_ms=ms, gauges_ms=gauges() * 1e3))
print(json.dumps(out))
"""


def life(root: Path, first: int, n: int, sinks: list[str], repo: Path) -> list[dict[str, float]]:
    env = {**os.environ, "PYTHONPATH": str(repo)}
    cmd = [sys.executable, "-c", LIFE, str(root), str(first), str(n), *sinks]
    r = subprocess.run(cmd, env=env, cwd=repo, check=True, capture_output=True, text=True)
    return json.loads(r.stdout)


def print_life(n: int, runs: dict[str, list[dict[str, float]]]) -> None:
    print(
        f"\n{n:,} more steps through the journal API (retention keeping 3), each checkout on its own journal"
    )
    print("| checkout | steps run | journal file MiB | bytes in use MiB | ms per step | gauge refresh ms |")
    print("|---|---|---|---|---|---|")
    for name, rows in runs.items():
        for r in rows:
            ms = "-" if r["step_ms"] is None else f"{r['step_ms']:.2f}"
            print(
                f"| {name} | {r['steps']:,} | {r['file'] / 2**20:.1f} | {r['used'] / 2**20:.1f} | {ms} "
                f"| {r['gauges_ms']:.2f} |"
            )
        print(f"| {name}: its first retire | | | | {rows[0]['first_ms']:.0f} | |")
        grew = rows[-1]["used"] - rows[1]["used"]
        per = grew / max(rows[-1]["steps"] - rows[1]["steps"], 1)
        print(f"| {name}: bytes in use per step, after the first part | | | {per:.0f} B | | |")


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
    ap.add_argument("--life", type=int, default=5000, help="steps run through the journal after the tools")
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
        if args.life:  # on a journal fresh from `make_root`: the tools' `watch --once` retired its live step
            for name, root in roots.items():
                shutil.rmtree(root)
                root.mkdir()
                make_root(root, args.steps, sinks, repos[name])
            runs = {
                name: life(roots[name], args.steps + 1, args.life, sinks, repo)
                for name, repo in repos.items()
            }
            print_life(args.life, runs)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
