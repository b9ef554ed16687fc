"""Benchmark `stagerd watch`: flat memory over many steps, pickup latency, and pipeline overhead.

    python bench/bench_daemon.py [--steps 50] [--mb 64] [--interval 1.0] [--big-mb 512] [--big-steps 5]
                                 [--burst 3] [--idle-s 3] [--skip-e2e] [--json OUT]

Every daemon is a real `stagerd watch` subprocess with a file:// sink (`--nice 0 --io-class none`, so
that the comparison with work done in this process is like for like). Steps are shards copied from one
real gloo DCP save of fp32 tensors, then a commit marker written last, as the Stager does.

1. Paced: `--steps` small steps, one per `--interval` s, `--keep-last 2`. The daemon's RSS is sampled
   from /proc every 0.1 s: idle (started, nothing staged, `--idle-s` seconds), busy (median and peak
   while steps export and publish), idle again after the last step, and steps 5-10 against the last 5
   (flat memory). Marker -> export-start latency is
   taken from the moment the marker is durable and visible (after the writer's fsyncs); from the marker's
   mtime it also includes the writer's own fsync time.
2. End to end: `--big-steps` larger steps, one at a time; each is preceded by `export_step` alone plus
   `FsspecSink.publish` alone on a copy of the same step, in this process, and reported as marker ->
   published over (export + upload alone), with the daemon's own export and upload times and the rest
   (pickup, journal, scheduling). Target: <= 1.15x. No retention here: deleting an old step while the
   next one exports competes for the same disk, which is retention's cost, not the pipeline's.
3. Burst: `--burst` larger steps committed at once: wall time from the first marker to the last published
   against burst x (export + upload) one after the other; below 1.0 means publish overlapped the next
   export.
4. `--steady` (only this): a trainer process writes a >= 1 GB step every `--steady-interval` s, the
   daemon exports it with a cast and publishes it; its export time against a keep export and a bare
   `cp -r` of the same step made at that moment (`bench/daemon_steady.py`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

N_TENSORS = 8


def builder():
    """fp32 tensors sharded on dim 0: a pure byte-copy export (no cast, no torch in the daemon)."""
    import torch

    rows = int(os.environ["BENCH_ROWS"])
    g = torch.Generator().manual_seed(0)
    return {
        f"model.layers.{i}.weight": (torch.randn(rows, 1024, generator=g), "S0") for i in range(N_TENSORS)
    }


def rss_kib(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except FileNotFoundError:
        return None
    return None


def commit(root: Path, step: int, model_src: Path, world: int) -> Path:
    from tests.dcp_fixtures import commit_step

    step_dir = root / f"step-{step:08d}"
    shutil.copytree(model_src, step_dir / "model")
    commit_step(step_dir, world)
    return step_dir


def baseline(work: Path, model_src: Path, world: int, repeats: int = 2) -> tuple[float, float]:
    """Median seconds of export alone and of a file:// publish alone."""
    from stagerd.engine.export import export_step
    from stagerd.sinks import open_sink

    exports, uploads = [], []
    for i in range(repeats):
        step_dir = commit(work / f"alone{i}", i + 1, model_src, world)
        t0 = time.perf_counter()
        export_step(step_dir, threads=2)
        exports.append(time.perf_counter() - t0)
        sink = open_sink((work / f"alone-sink{i}").as_uri())
        t0 = time.perf_counter()
        sink.publish(step_dir / "export", i + 1)
        uploads.append(time.perf_counter() - t0)
        sink.close()
        shutil.rmtree(work / f"alone{i}")
        shutil.rmtree(work / f"alone-sink{i}")
    return statistics.median(exports), statistics.median(uploads)


def run_daemon(root: Path, sink: Path, log: Path, *extra: str, repo: Path = REPO) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("STAGERD_")}
    env["PYTHONPATH"] = str(repo)
    args = [sys.executable, "-m", "stagerd.cli", "watch", str(root), "--sink", sink.as_uri()]
    args += ["--metrics-port", "0", "--nice", "0", "--io-class", "none", *extra]
    return subprocess.Popen(args, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env, cwd=repo)


def wait_published(
    root: Path, steps: list[int], proc: subprocess.Popen, samples: list, timeout: float
) -> None:
    from stagerd.daemon.journal import Journal

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"daemon exited with {proc.returncode}")
        samples.append((time.monotonic(), rss_kib(proc.pid)))
        try:
            j = Journal.open_readonly(root)
            done = {r.step for r in j.steps() if r.state in ("published", "retired")}
            j.close()
        except Exception:
            done = set()
        if set(steps) <= done:
            return
        time.sleep(0.2)
    raise SystemExit(f"timed out waiting for steps {steps}")


def step_times(root: Path) -> dict[int, dict[str, float]]:
    from stagerd.daemon.journal import Journal

    j = Journal.open_readonly(root)
    try:
        out = {}
        upload = {ln.step: ln.seconds for ln in j.lanes()}
        for r in j.steps():
            out[r.step] = {
                "upload": upload.get(r.step),
                "pickup": r.export_started - r.marker_mtime,
                "export_started": r.export_started,
                "export": r.export_seconds,
                "to_published": r.published_at - r.marker_mtime,
                "published_at": r.published_at,
            }
        return out
    finally:
        j.close()


def settle() -> None:
    """Flush dirty pages so one measurement does not pay for the previous one's writeback."""
    os.sync()
    time.sleep(0.5)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def make_template(work: Path, name: str, mb: int, world: int) -> tuple[Path, int]:
    """One real gloo DCP save of `mb` MB of fp32; returns its model dir and size."""
    from tests.dcp_fixtures import dcp_save

    os.environ["BENCH_ROWS"] = str(max(world, mb * 1_000_000 // (4 * 1024 * N_TENSORS)))
    model = work / name / "model"
    t0 = time.perf_counter()
    dcp_save(model, world=world, builder=builder)
    size = sum(p.stat().st_size for p in model.iterdir())
    print(f"{name}: {size / 1e6:.0f} MB, {world} ranks, saved in {time.perf_counter() - t0:.1f}s")
    return model, size


def sample_rss(pid: int, seconds: float) -> list[int]:
    """The process's RSS in KiB every 0.1 s for `seconds`."""
    out = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        kib = rss_kib(pid)
        if kib:
            out.append(kib)
        time.sleep(0.1)
    return out


def paced(work: Path, model: Path, world: int, steps: int, interval: float, idle_s: float = 3.0) -> dict:
    """Many steps, one per `interval`: daemon RSS idle, busy and over time, and marker -> export-start
    latency."""
    root, sink = work / "paced-root", work / "paced-sink"
    root.mkdir()
    proc = run_daemon(root, sink, work / "paced.log", "--keep-last", "2")
    samples: list[tuple[float, int | None]] = []
    visible: dict[int, float] = {}
    try:
        time.sleep(1.5)
        idle_before = sample_rss(proc.pid, idle_s)  # started, watching, nothing to do yet
        for step in range(1, steps + 1):
            commit(root, step, model, world)
            visible[step] = time.time()  # the marker is durable and visible from here
            next_at = time.monotonic() + interval
            while time.monotonic() < next_at:
                samples.append((time.time(), rss_kib(proc.pid)))
                time.sleep(0.1)
        wait_published(root, list(visible), proc, samples, timeout=300)
        idle_after = sample_rss(proc.pid, idle_s)  # every step published: back to watching
        times = step_times(root)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)

    def at(step: int) -> float:  # a short run's windows overlap rather than name a step it never saved
        return visible[min(max(1, step), steps)]

    every = [k for _, k in samples if k]
    early = [k for t, k in samples if k and at(5) <= t <= at(10)] or every
    mid = [k for t, k in samples if k and at(steps // 2 - 3) <= t <= at(steps // 2 + 3)] or every
    late = [k for t, k in samples if k and t >= at(steps - 5)] or every
    pickups = [times[s]["export_started"] - visible[s] for s in visible]
    from_mtime = [times[s]["pickup"] for s in visible]
    out = {
        "steps": steps,
        "rss_mib_steps_5_10": max(early) / 1024,
        "rss_mib_middle": max(mid) / 1024,
        "rss_mib_last_5": max(late) / 1024,
        "rss_mib_peak": max(k for _, k in samples if k) / 1024,
        "rss_mib_idle_before": statistics.median(idle_before) / 1024,
        "rss_mib_idle_after": statistics.median(idle_after) / 1024,
        "rss_mib_busy_median": statistics.median(k for _, k in samples if k) / 1024,
        "pickup_ms_p50": pct(pickups, 0.5) * 1000,
        "pickup_ms_p95": pct(pickups, 0.95) * 1000,
        "pickup_ms_max": max(pickups) * 1000,
        "pickup_from_mtime_ms_p50": pct(from_mtime, 0.5) * 1000,
    }
    print(
        f"paced, {steps} steps, one per {interval}s: daemon RSS {out['rss_mib_steps_5_10']:.0f} MiB at steps "
        f"5-10, {out['rss_mib_middle']:.0f} MiB mid-way, {out['rss_mib_last_5']:.0f} MiB over the last 5, "
        f"peak {out['rss_mib_peak']:.0f} MiB"
    )
    print(
        f"daemon RSS idle {out['rss_mib_idle_before']:.0f} MiB before the first step, busy median "
        f"{out['rss_mib_busy_median']:.0f} MiB and peak {out['rss_mib_peak']:.0f} MiB while exporting and "
        f"publishing, idle {out['rss_mib_idle_after']:.0f} MiB after the last (median of 0.1 s samples over "
        f"{idle_s:.0f} s; load average {os.getloadavg()[0]:.1f})"
    )
    print(
        f"marker visible -> export start: p50 {out['pickup_ms_p50']:.0f} ms, "
        f"p95 {out['pickup_ms_p95']:.0f} ms, max {out['pickup_ms_max']:.0f} ms "
        f"(from the marker's mtime, p50 {out['pickup_from_mtime_ms_p50']:.0f} ms)"
    )
    return out


def end_to_end(work: Path, model: Path, world: int, steps: int, burst: int) -> dict:
    """Marker -> published per step (one at a time), each against export + upload alone measured just
    before it (the machine is shared: pairs drift together), then a burst committed at once (overlap)."""
    root, sink = work / "e2e-root", work / "e2e-sink"
    root.mkdir()
    proc = run_daemon(root, sink, work / "e2e.log")
    ratios, alones = [], []
    try:
        time.sleep(1.5)
        for step in range(1, steps + 1):
            settle()
            exp_alone, up_alone = baseline(work, model, world, repeats=1)
            alone = exp_alone + up_alone
            alones.append((exp_alone, up_alone))
            settle()
            commit(root, step, model, world)
            visible = time.time()
            wait_published(root, [step], proc, [], timeout=300)
            t = step_times(root)[step]
            took = t["published_at"] - visible
            ratios.append(took / alone)
            print(
                f"  step {step}: alone export {exp_alone:.2f}s + upload {up_alone:.2f}s = {alone:.2f}s; "
                f"daemon marker -> published {took:.2f}s ({took / alone:.2f}x): "
                f"its export {t['export']:.2f}s + upload {t['upload']:.2f}s "
                f"+ the rest {took - t['export'] - t['upload']:.2f}s"
            )
            shutil.rmtree(sink / f"step-{step:08d}")  # published and recorded: only bounds the disk
        alone = statistics.median(e + u for e, u in alones)
        from tests.dcp_fixtures import commit_step

        staged = [work / "burst" / f"step-{s:08d}" for s in range(steps + 1, steps + burst + 1)]
        for d in staged:  # copy first; the burst is the markers
            shutil.copytree(model, d / "model")
        settle()
        t_first = time.time()
        for d in staged:
            os.rename(d, root / d.name)
            commit_step(root / d.name, world)
        wait_published(root, [int(d.name[5:]) for d in staged], proc, [], timeout=600)
        times = step_times(root)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    wall = max(times[int(d.name[5:])]["published_at"] for d in staged) - t_first
    for d in staged:
        t = times[int(d.name[5:])]
        print(f"  burst step {d.name}: export {t['export']:.2f}s, upload {t['upload']:.2f}s")
    out = {
        "alone_export_upload_s": alones,
        "to_published_over_alone": ratios,
        "burst_steps": burst,
        "burst_wall_s": wall,
        "burst_sequential_s": burst * alone,
    }
    print(
        f"marker visible -> published, over (export + upload alone): median {statistics.median(ratios):.2f}x "
        "(target <= 1.15x)"
    )
    print(
        f"burst of {burst}: {wall:.2f}s from the first marker to the last published, vs {burst * alone:.2f}s "
        f"one after the other ({wall / (burst * alone):.2f}x; < 1 means publish overlapped the next export)"
    )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=50, help="steps in the paced (memory, latency) run")
    ap.add_argument("--mb", type=int, default=64, help="checkpoint size of the paced run, MB of fp32")
    ap.add_argument("--interval", type=float, default=1.0, help="seconds between paced steps")
    ap.add_argument("--big-mb", type=int, default=512, help="checkpoint size of the end-to-end run")
    ap.add_argument("--big-steps", type=int, default=5, help="steps published one at a time")
    ap.add_argument("--burst", type=int, default=3, help="steps committed at once")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--idle-s", type=float, default=3.0, help="seconds of idle RSS samples")
    ap.add_argument("--skip-e2e", action="store_true", help="only the paced run (RSS and pickup)")
    ap.add_argument("--json", type=Path, help="write the results here too")
    ap.add_argument("--steady", action="store_true", help="only the steady-state run (daemon_steady.py)")
    ap.add_argument("--steady-steps", type=int, default=8)
    ap.add_argument("--steady-interval", dest="interval_steady", type=float, default=30.0)
    ap.add_argument("--size-gb", type=float, default=1.6, help="steady: the template's --size-gb")
    ap.add_argument("--world-steady", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repo", type=Path, default=REPO, help="steady: the checkout the daemon runs")
    ap.add_argument("--template", type=Path, help="steady: a directory of DCP shards to stage each step")
    ap.add_argument("--dir", type=Path, default=None, help="work directory's parent (default: tmp)")
    a = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="stagerd-bench-daemon-", dir=a.dir)).resolve()
    try:
        if a.steady:
            from daemon_steady import steady

            result = {"steady": steady(work, a.repo.resolve(), a, run_daemon, wait_published, step_times)}
            if a.json:
                a.json.write_text(json.dumps(result, indent=2))
            return
        small, _ = make_template(work, "small", a.mb, a.world)
        result = {"paced": paced(work, small, a.world, a.steps, a.interval, a.idle_s)}
        shutil.rmtree(work / "paced-root")
        shutil.rmtree(work / "paced-sink", ignore_errors=True)

        if not a.skip_e2e:
            big, size = make_template(work, "big", a.big_mb, a.world)
            e2e = end_to_end(work, big, a.world, a.big_steps, a.burst)
            result["end_to_end"] = {"size_mb": size / 1e6, **e2e}
        if a.json:
            a.json.write_text(json.dumps(result, indent=2))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
