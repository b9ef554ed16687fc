"""Paired A/B of two git revisions: run one bench from each revision's tree, interleaved, on the same machine.

    python bench/ab_revisions.py 719ae7f^ HEAD --rounds 3 -- bench/bench_consolidate.py --size-gb 1
    python bench/ab_revisions.py 719ae7f^ HEAD -- bench/bench_daemon.py --steps 20 --big-mb 256

Each revision is checked out into its own worktree, so the bench script and the code it drives are both that
revision's (the benches put their own tree first on PYTHONPATH). Rounds alternate A, B, A, B, ... so a load
that comes and goes on a shared machine lands on both sides alike. Every numeric field the bench writes with
`--json` is reported as A's and B's median with their spread (min-max), and B/A of the medians.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _numbers(obj: object, prefix: str = "") -> dict[str, float]:
    """Every numeric leaf of a JSON document, by its dotted path."""
    out: dict[str, float] = {}
    if isinstance(obj, dict):
        for key, value in obj.items():
            out.update(_numbers(value, f"{prefix}{key}."))
    elif isinstance(obj, list):
        for index, value in enumerate(obj):
            out.update(_numbers(value, f"{prefix}{index}."))
    elif isinstance(obj, (int, float)) and not isinstance(obj, bool):
        out[prefix.rstrip(".")] = float(obj)
    return out


def _worktree(rev: str, base: Path, name: str) -> Path:
    tree = base / name
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "-q", "--detach", str(tree), rev], check=True)
    return tree


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("a", help="the baseline revision")
    ap.add_argument("b", help="the revision measured against it")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", type=Path, help="write every round's numbers here too")
    argv = sys.argv[1:]
    if "--" not in argv or argv.index("--") == len(argv) - 1:
        ap.error("name the bench to run after --: ... -- bench/BENCH.py ARGS")
    cut = argv.index("--")
    args = ap.parse_args(argv[:cut])
    bench = argv[cut + 1 :]
    runs: dict[str, list[dict[str, float]]] = {"a": [], "b": []}
    with tempfile.TemporaryDirectory(prefix="stagerd-ab-") as tmp:
        base = Path(tmp)
        trees = {"a": _worktree(args.a, base, "a"), "b": _worktree(args.b, base, "b")}
        try:
            for round_no in range(args.rounds):
                for side in ("a", "b"):
                    out = base / f"{side}-{round_no}.json"
                    cmd = [sys.executable, str(trees[side] / bench[0]), *bench[1:], "--json", str(out)]
                    print(f"round {round_no + 1}, {side}: {' '.join(cmd[1:])}", flush=True)
                    subprocess.run(cmd, cwd=trees[side], check=True, stdout=subprocess.DEVNULL)
                    runs[side].append(_numbers(json.loads(out.read_text())))
        finally:
            for tree in trees.values():
                remove = ["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)]
                subprocess.run(remove, check=False)
    if args.json:
        args.json.write_text(json.dumps({"a": args.a, "b": args.b, "bench": bench, "runs": runs}, indent=1))
    keys = sorted(set.intersection(*(set(r) for r in runs["a"] + runs["b"])))
    print(f"\nA = {args.a}, B = {args.b}, {args.rounds} interleaved rounds of {' '.join(bench)}")
    print(f"{'field':52} {'A median (min-max)':>26} {'B median (min-max)':>26} {'B/A':>6}")
    for key in keys:
        a = [r[key] for r in runs["a"]]
        b = [r[key] for r in runs["b"]]
        ma, mb = statistics.median(a), statistics.median(b)
        ratio = f"{mb / ma:6.2f}" if ma else "     -"
        print(
            f"{key[:52]:52} {ma:>12.4g} ({min(a):.4g}-{max(a):.4g})".ljust(80)
            + f"{mb:>12.4g} ({min(b):.4g}-{max(b):.4g})".ljust(27)
            + ratio
        )


if __name__ == "__main__":
    main()
