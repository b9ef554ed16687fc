"""`bench_daemon.py --steady`: the daemon in its steady state, where every export follows a big write.

A trainer process writes a staged step (the shards of one real gloo DCP save: mixed fp32 / bf16 / fp16,
`Shard(0)`, `Shard(1)` and 2-D mesh blocks, >= 1 GB) every `--steady-interval` seconds, with plain
`write`s from memory and an fsync, as the Stager's background writer does, then commits it. A real
`stagerd watch` exports each step with a cast (`--dtype bf16`) and publishes it to a file:// sink,
`--keep-last 2` (so retention frees old steps while new ones land). At each step, in the same
conditions, a probe process times a keep export of the same step (`consolidate_into`, in-process as the
daemon's own export is) and this one a bare `cp -r` of its shards: before the step is committed on even
steps, after it is published on odd ones, so neither always runs second. Reported per step and as
medians: the daemon's export over keep and over cp.

    python bench/bench_daemon.py --steady --steady-steps 8 --steady-interval 30 --size-gb 1.6
    python bench/bench_daemon.py --steady ... --repo /path/to/other/checkout   # the same, other code
    python bench/bench_daemon.py --steady ... --template DIR   # shards of an earlier save, not a new one
"""

from __future__ import annotations

import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
CHUNK = 8 << 20


def trainer(template: str, root: str, steps: int, interval: float, world: int) -> None:
    """The trainer process: each step's shards written from memory at a fixed interval; it says `written
    K` and commits once it reads `commit K`."""
    sys.path.insert(0, str(BENCH.parent))
    from tests.dcp_fixtures import commit_step

    names = sorted(p.name for p in Path(template).iterdir())
    data = {n: Path(template, n).read_bytes() for n in names}  # the step's state, held in memory
    start = time.monotonic()
    for k in range(1, steps + 1):
        time.sleep(max(0.0, start + k * interval - time.monotonic()))
        step = Path(root) / f".step-{k:08d}.tmp"
        (step / "model").mkdir(parents=True)
        for n in names:
            fd = os.open(step / "model" / n, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            view = memoryview(data[n])
            for off in range(0, len(view), CHUNK):
                os.write(fd, view[off : off + CHUNK])
            os.fsync(fd)
            os.close(fd)
        print(f"written {k}", flush=True)
        if sys.stdin.readline().strip() != f"commit {k}":
            raise SystemExit("trainer: out of step with the bench")
        final = Path(root) / f"step-{k:08d}"
        os.rename(step, final)
        commit_step(final, world)


def prober() -> None:
    """The probe process: `keep SRC OUT THREADS` runs a keep export in-process, as the daemon runs its
    own (so neither pays an interpreter start), and answers its seconds."""
    from stagerd.engine.consolidate import consolidate_into

    for line in sys.stdin:
        _, src, out, threads = line.split()
        Path(out).mkdir()
        t0 = time.perf_counter()
        consolidate_into(Path(src), Path(out), threads=int(threads))
        print(f"{time.perf_counter() - t0:.6f}", flush=True)


def probes(probe: subprocess.Popen, model: Path, scratch: Path, threads: int) -> tuple[float, float]:
    """(keep export s, bare cp -r s) of `model`, each output deleted at once."""
    assert probe.stdin is not None and probe.stdout is not None
    probe.stdin.write(f"keep {model} {scratch / 'keep'} {threads}\n")
    probe.stdin.flush()
    keep = float(probe.stdout.readline())
    shutil.rmtree(scratch / "keep")
    t0 = time.perf_counter()
    subprocess.run(["cp", "-r", str(model), str(scratch / "cp")], check=True)
    cp = time.perf_counter() - t0
    shutil.rmtree(scratch / "cp")
    return keep, cp


def steady(work: Path, repo: Path, args, run_daemon, wait_published, step_times) -> dict:
    """The steady-state run; the daemon helpers come from bench_daemon.py."""
    sys.path.insert(0, str(BENCH))
    from bench_consolidate import generate

    template = args.template or work / "template"
    if args.template is None:
        generate(template, args.size_gb, args.world_steady, 2, True, 0)
        (template / "mapping.json").unlink(missing_ok=True)
    size = sum(p.stat().st_size for p in template.iterdir())
    print(f"template: {size / 1e9:.2f} GB, {args.world_steady} ranks, mixed dtypes, Shard(1) and 2-D blocks")
    root, sink, scratch = work / "steady-root", work / "steady-sink", work / "scratch"
    for d in (root, scratch):
        d.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("STAGERD_")}
    env["PYTHONPATH"] = str(repo)
    daemon = run_daemon(root, sink, work / "steady.log", "--dtype", "bf16", "--keep-last", "2", repo=repo)
    probe = subprocess.Popen(
        [sys.executable, __file__, "--probe"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    cmd = [sys.executable, __file__, "--trainer", str(template), str(root), str(args.steady_steps)]
    train = subprocess.Popen(
        [*cmd, str(args.interval_steady), str(args.world_steady)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert train.stdin is not None and train.stdout is not None
    rows = []
    try:
        for k in range(1, args.steady_steps + 1):
            if train.stdout.readline().strip() != f"written {k}":
                raise SystemExit("trainer stopped")
            model = root / f".step-{k:08d}.tmp" / "model"
            before = k % 2 == 0
            if before:  # the probes first, on the uncommitted step
                keep, cp = probes(probe, model, scratch, args.threads)
            train.stdin.write(f"commit {k}\n")
            train.stdin.flush()
            wait_published(root, [k], daemon, [], timeout=600)
            if not before:
                keep, cp = probes(probe, root / f"step-{k:08d}" / "model", scratch, args.threads)
            t = step_times(root)[k]
            export, upload = t["export"], t["upload"]
            rows.append((k, export, keep, cp, os.getloadavg()[0], "before" if before else "after", upload))
            print(
                f"step {k}: daemon export (bf16) {export:.2f} s, publish {upload:.2f} s, keep {keep:.2f} s, "
                f"cp -r {cp:.2f} s (probes {rows[-1][5]} the daemon's export), load {rows[-1][4]:.1f}",
                flush=True,
            )
            shutil.rmtree(sink / f"step-{k:08d}", ignore_errors=True)  # published: only bounds the disk
    finally:
        train.kill()
        probe.kill()
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(60)
    return report(rows[1:] if len(rows) > 2 else rows, size)  # the first step warms the daemon up


def report(rows: list[tuple], size: int) -> dict:
    ex, kp, cp = ([r[i] for r in rows] for i in (1, 2, 3))
    over_keep = sorted(e / k for e, k in zip(ex, kp, strict=True))
    over_cp = sorted(e / c for e, c in zip(ex, cp, strict=True))
    loads = [r[4] for r in rows]
    print(
        f"\nsteady state: {len(rows)} steps of {size / 1e9:.2f} GB (the first left out), "
        f"load average {min(loads):.1f}-{max(loads):.1f}\n"
    )
    print("| | median s | min-max s |")
    print("|---|---|---|")
    for name, xs in (
        ("daemon export, bf16 (fsynced)", ex),
        ("daemon publish to file:// (reads the export)", [r[6] for r in rows]),
        ("keep export (fsynced)", kp),
        ("bare cp -r", cp),
    ):
        print(f"| {name} | {statistics.median(xs):.2f} | {min(xs):.2f}-{max(xs):.2f} |")
    print(
        f"\nexport / keep, paired by step: median {statistics.median(over_keep):.2f}x "
        f"({over_keep[0]:.2f}-{over_keep[-1]:.2f}); export / cp -r: median {statistics.median(over_cp):.2f}x "
        f"({over_cp[0]:.2f}-{over_cp[-1]:.2f})"
    )
    return {"rows": rows, "export_over_keep": over_keep, "export_over_cp": over_cp, "size": size}


if __name__ == "__main__":
    if sys.argv[1:] == ["--probe"]:
        prober()
    elif len(sys.argv) == 7 and sys.argv[1] == "--trainer":
        a = sys.argv
        trainer(a[2], a[3], int(a[4]), float(a[5]), int(a[6]))
