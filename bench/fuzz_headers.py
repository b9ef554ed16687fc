"""Long fuzz run of the header parser and the planner behind it, oracle from tests/contract/fuzz/oracle.py.

Seeds are the shard headers of a real 4-rank gloo DCP save (made here, or `--seeds DIR` of *.safetensors).
Three generators run side by side so their reach can be compared: random bytes, random JSON, and
structure-aware mutation of the real headers. Every input is checked for: no exception but the named ones,
no input over the per-input time bound, consistent acceptance; every `--mem-every`th input also runs under
tracemalloc, and every `--file-every`th goes through `read_header` from a file. Failures are counted by
(exception, place), saved as reproducer files, and the run goes on; the exit status is 1 if any occurred.

    python bench/fuzz_headers.py --count 40000                 # 40k inputs per generator, 120k in all
    python bench/fuzz_headers.py --atheris --count 100000      # coverage-guided (atheris / libFuzzer)

Results are printed as a table and written as JSON to `--json FILE`.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import os
import random
import re
import sys
import tempfile
import time
import traceback
import tracemalloc
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# A parse may trace this much plus MEM_PER_BYTE per input byte: the JSON text, its str and the decoded
# tree (`[[],[],...]` costs ~21 bytes of objects per input byte). Anything proportional to a claimed
# length, shape or offset (up to 2^64) blows far past it.
MEM_BASE = 64 * 1024
MEM_PER_BYTE = 32


class Run:
    """Counters of one generator's run."""

    def __init__(self, name: str, crash_dir: Path) -> None:
        self.name = name
        self.crash_dir = crash_dir
        self.count = 0
        self.seconds = 0.0
        self.slowest = 0.0
        self.outcomes: Counter = Counter()
        self.failures: Counter = Counter()
        self.mem_checks = 0
        self.mem_peak = 0
        self.mem_peak_ratio = 0.0
        self.file_checks = 0

    def failed(self, blob: bytes, e: BaseException) -> None:
        tb = traceback.extract_tb(e.__traceback__)
        where = next(
            (f"{Path(f.filename).name}:{f.lineno}" for f in reversed(tb) if "/stagerd/" in f.filename),
            f"{Path(tb[-1].filename).name}:{tb[-1].lineno}" if tb else "?",
        )
        key = f"{type(e).__name__} at {where}: {re.sub(r'[0-9]+', 'N', str(e))[:90]}"
        if key not in self.failures:
            self.crash_dir.mkdir(parents=True, exist_ok=True)
            (self.crash_dir / f"{self.name}-{hashlib.sha256(blob).hexdigest()[:16]}.bin").write_bytes(blob)
        self.failures[key] += 1

    def summary(self) -> dict[str, Any]:
        deep = sum(v for o, v in self.outcomes.items() if o.stage in ("sharding", "plan", "accepted"))
        return {
            "generator": self.name,
            "inputs": self.count,
            "seconds": round(self.seconds, 2),
            "inputs_per_s": round(self.count / max(self.seconds, 1e-9)),
            "slowest_input_ms": round(self.slowest * 1e3, 2),
            "distinct_outcomes": len(self.outcomes),
            "stages": dict(Counter(o.stage for o in self.outcomes.elements())),
            "past_the_framing_percent": round(100 * deep / max(self.count, 1), 1),
            "mem_checks": self.mem_checks,
            "mem_peak_bytes": self.mem_peak,
            "failures": dict(self.failures),
        }


def check_one(run: Run, blob: bytes, companions, *, mem: bool, file_dir: Path | None) -> None:
    """One input through the oracle, recording its outcome or its failure."""
    from tests.contract.fuzz.oracle import Meter, parse_blob, parse_file

    t0 = time.perf_counter()
    try:
        meter = Meter()
        if mem:
            tracemalloc.start()
        try:
            outcome = parse_blob(blob, companions=companions, meter=meter)
        finally:
            if mem:
                tracemalloc.stop()
                run.mem_checks += 1
                run.mem_peak = max(run.mem_peak, meter.peak)
                if meter.peak > MEM_BASE + MEM_PER_BYTE * len(blob):
                    raise MemoryError(f"the parser traced {meter.peak} bytes for a {len(blob)}-byte input")
        run.outcomes[outcome] += 1
        if file_dir is not None:
            p = file_dir / "input.safetensors"
            p.write_bytes(blob)
            from_file = parse_file(p)
            run.file_checks += 1
            if (from_file.stage == "accepted") != (outcome.stage in ("plan", "accepted")):
                raise AssertionError(f"read_header says {from_file}, the in-memory parse {outcome}")
    except Exception as e:  # every failure is recorded; the run goes on
        run.failed(blob, e)
    dt = time.perf_counter() - t0
    run.count += 1
    run.seconds += dt
    run.slowest = max(run.slowest, dt)


def make_seeds(seeds_dir: Path | None, work: Path) -> list:
    from tests.contract.fuzz.oracle import load_seeds

    if seeds_dir is None:
        from tests.dcp_fixtures import dcp_save

        seeds_dir = work / "model"
        t0 = time.monotonic()
        dcp_save(seeds_dir, world=4)
        print(f"seeds: real 4-rank gloo DCP save in {time.monotonic() - t0:.1f} s", flush=True)
    seeds = load_seeds(seeds_dir)
    from tests.contract.fuzz.oracle import parse_blob

    for s in seeds:  # warm up: lazy imports (numpy in the planner) must not count as an input's allocation
        parse_blob(s.blob(), companions=s.companions)
    return seeds


def run_generators(seeds: list, count: int, seed: int, args: argparse.Namespace, work: Path) -> list[Run]:
    from tests.contract.fuzz.inputs import mutate, random_bytes, random_json_blob

    gens = {
        "random-bytes": lambda r: (random_bytes(r), ()),
        "random-json": lambda r: (random_json_blob(r), ()),
        "mutate-real-dcp": lambda r: (lambda s: (mutate(s, r), s.companions))(r.choice(seeds)),
    }
    runs = []
    for name, gen in gens.items():
        run = Run(name, work / "crashes")
        r = random.Random(f"{seed}-{name}")
        for i in range(count):
            blob, companions = gen(r)
            check_one(
                run,
                blob,
                companions,
                mem=i % args.mem_every == 0,
                file_dir=work if i % args.file_every == 0 else None,
            )
        print(
            f"{name}: {run.count} inputs in {run.seconds:.1f} s, {len(run.failures)} failure kinds",
            flush=True,
        )
        runs.append(run)
    return runs


def run_atheris(seeds: list, count: int, args: argparse.Namespace, work: Path) -> list[Run]:
    """Coverage-guided: libFuzzer's mutations plus the structure-aware mutator, on instrumented stagerd."""
    import atheris

    from tests.contract.fuzz.inputs import mutate
    from tests.contract.fuzz.oracle import Seed

    run = Run("atheris", work / "crashes")
    corpus = work / "corpus"
    corpus.mkdir(exist_ok=True)
    for s in seeds:
        (corpus / s.name).write_bytes(s.blob())

    t0 = time.monotonic()

    def one_input(data: bytes) -> None:
        i = run.count
        check_one(
            run, data, (), mem=i % args.mem_every == 0, file_dir=work if i % args.file_every == 0 else None
        )
        if run.count >= count:  # libFuzzer ends with C exit(), which skips Python: report from here
            code = report([run], time.monotonic() - t0, args, work)
            sys.stdout.flush()
            os._exit(code)

    def custom_mutator(data: bytes, max_size: int, seed: int) -> bytes:
        r = random.Random(seed)
        if r.random() < 0.5:
            return atheris.Mutate(data, max_size)
        try:
            base = Seed.from_bytes(data)
        except Exception:
            base = r.choice(seeds)
        return mutate(base, r)[:max_size]

    atheris.Setup(
        [
            sys.argv[0],
            f"-runs={count + 1}",
            "-max_len=262144",
            f"-rss_limit_mb={args.rss_limit_mb}",
            str(corpus),
        ],
        one_input,
        custom_mutator=custom_mutator,
    )
    atheris.Fuzz()
    return [run]  # not reached while one_input ends the process


def report(runs: list[Run], wall: float, args: argparse.Namespace, work: Path) -> int:
    """Print the table, write the JSON; the exit status: 1 if any input failed."""
    results = {
        "python": sys.version.split()[0],
        "cpus": os.cpu_count(),
        "wall_seconds": round(wall, 1),
        "total_inputs": sum(r.count for r in runs),
        "runs": [r.summary() for r in runs],
        "reproducers": str(work / "crashes"),
    }
    print()
    print(
        f"{'generator':<16} {'inputs':>8} {'s':>7} {'in/s':>7} {'slowest ms':>10} {'outcomes':>8} "
        f"{'deep %':>6} {'mem peak':>9} {'failures':>8}"
    )
    for s in results["runs"]:
        print(
            f"{s['generator']:<16} {s['inputs']:>8} {s['seconds']:>7} {s['inputs_per_s']:>7} "
            f"{s['slowest_input_ms']:>10} {s['distinct_outcomes']:>8} {s['past_the_framing_percent']:>6} "
            f"{s['mem_peak_bytes']:>9} {sum(s['failures'].values()):>8}"
        )
        for k, v in s["failures"].items():
            print(f"    {v:>6} x {k}")
    print(f"total: {results['total_inputs']} inputs in {wall:.1f} s; reproducers under {work / 'crashes'}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 1 if any(r.failures for r in runs) else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--count", type=int, default=40_000, help="inputs per generator (atheris: runs)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--seeds", type=Path, help="directory of real DCP *.safetensors shards (default: save one)"
    )
    ap.add_argument("--mem-every", type=int, default=25, help="tracemalloc every Nth input")
    ap.add_argument("--file-every", type=int, default=20, help="read_header from a file every Nth input")
    ap.add_argument("--atheris", action="store_true", help="coverage-guided fuzzing with atheris")
    ap.add_argument("--rss-limit-mb", type=int, default=2048)
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--work", type=Path, help="keep seeds, corpus and reproducers here (default: a temp dir)")
    args = ap.parse_args()

    if args.atheris:  # coverage instrumentation applies only to modules imported after this
        import atheris

        with atheris.instrument_imports(include=["stagerd"]):
            for mod in ("dtypes", "safetensors_format", "sharding", "consolidate"):
                importlib.import_module(f"stagerd.{mod}")
    work = args.work or Path(tempfile.mkdtemp(prefix="stagerd-fuzz-"))
    work.mkdir(parents=True, exist_ok=True)
    seeds = make_seeds(args.seeds, work)
    t0 = time.monotonic()
    runs = (
        run_atheris(seeds, args.count, args, work)
        if args.atheris
        else run_generators(seeds, args.count, args.seed, args, work)
    )
    return report(runs, time.monotonic() - t0, args, work)


if __name__ == "__main__":
    sys.exit(main())
