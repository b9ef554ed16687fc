"""Goodput of a training loop that checkpoints: stagerd against torch's own saves, in one run.

    python bench/bench_goodput.py                      # a tiny Llama on CPU (seconds)
    python bench/bench_goodput.py --preset 1b          # a ~1B Llama on one GPU: bf16, fused AdamW

A transformers `LlamaForCausalLM` (built from a config, nothing downloaded) trains with AdamW; every K
steps the loop saves the model and the optimizer state with one method. Methods, one object each for the
whole run (so only the first save of each pays its start-up), runs interleaved:

- no saves (before and after the rest: the baseline step time);
- stagerd: `Stager.save()`, with `stagerd watch ROOT --sink file://... --keep-last 1` running beside it;
  `attach(optimizer)` makes `optimizer.step()` wait for the host copy (the documented placement);
- torch's best: `dcp.async_save`, PROCESS checkpointer + `DefaultStager(pinned, shared, async)`, the
  staging waited for right before the next optimizer step and the previous upload before the next save
  (torchtitan's async_with_pinned_mem; where torch 2.11's stager breaks on its second save, its `close()`
  is made a no-op, as the issue measured it);
- `dcp.async_save` with torch's defaults, and `dcp.save`.

stagerd and torch's best run at a long save interval (hidden: the copy under the next forward and
backward), a short one (shorter than the write), and unhidden (waiting right after the save: the copy's
own speed against the pinned D2H peak: the device is synchronized before these saves, off the stall's
clock, so the stall is the copy's and not the queued step's; stagerd's unhidden saves go to a root no
daemon watches, so their time to durable is the write's alone, as torch's always is). Every step ends
with `loss.item()`, as a loop that logs does. After each stagerd run the bench waits for the daemon to
publish its last step, so its backlog does not slow the next method's run.

Reported per method: stall per save (the loop blocked in save and its waits), loop time lost per save
(the save's K-step window against K baseline steps, against K of the run's own median step, and against K
of the median of the `--adjacent-steps` no-save steps measured right before and right after the run, each
no-save window after `--warm-steps` untimed steps, since after the GPU idled (a drain, the daemon
settling) steps run faster for a while; first save apart), time to durable (save until the marker or
torch's upload future) against the disk floor (the same bytes written sequentially with one `write`
stream and fsynced, measured in the same run), the D2H rate of unhidden saves against one large pinned
copy, and the step time while the daemon exports. For each stagerd run the daemon watched, its steps
while the daemon exported or published against while it was idle (in the run, and in the no-save steps
right after it): the daemon's effect apart from drift.
`--json FILE` keeps everything; `--report FILE` prints the tables from it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from goodput.daemon import DaemonWatch, settle_daemon, start_daemon
from goodput.disk import disk_floor
from goodput.loop import Adjacent, run, say
from goodput.model import PRESETS, build, state_bytes, train_step


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default=None, help="default: 1b with CUDA, else tiny")
    p.add_argument("--cpu", action="store_true", help="ignore CUDA")
    p.add_argument("--long", type=int, default=20, help="steps between saves, longer than a write")
    p.add_argument("--short", type=int, default=4, help="steps between saves, shorter than a write")
    p.add_argument("--saves", type=int, default=4, help="saves per run (the first is reported apart)")
    p.add_argument("--slow-saves", type=int, default=2, help="saves of the blocking torch methods")
    p.add_argument("--base-steps", type=int, default=30, help="steps without saves, before and after")
    p.add_argument(
        "--adjacent-steps",
        type=int,
        default=12,
        help="steps without saves right before and right after each method's run (0: none)",
    )
    p.add_argument(
        "--warm-steps",
        type=int,
        default=12,
        help="untimed steps before each no-save window: steps after an idle GPU run faster for a while",
    )
    p.add_argument("--threads", type=int, default=8, help="writer threads (stagerd and torch's writer)")
    p.add_argument("--root", default=None, help="checkpoint directory (default: a temp dir, removed)")
    p.add_argument("--json", default=None, help="write every figure to this file")
    p.add_argument("--no-daemon", action="store_true", help="stagerd without its daemon beside it")
    p.add_argument("--runs", default="long,short,unhidden,slow", help="which runs (comma-separated)")
    p.add_argument("--report", default=None, help="print the report of a --json file, measure nothing")
    p.add_argument(
        "--copy-variant",
        default=None,
        help="issue stagerd's host copy as bench_copy_pacing.py's VARIANTS[NAME], or best:FILE for the one "
        "its --json FILE found best (a comparison of ways, not the library's setting)",
    )
    args = p.parse_args()
    if args.report:
        from goodput.report import report

        print(report(json.loads(Path(args.report).read_text())))
        return
    import goodput.methods as gm
    import torch
    import torch.distributed as dist
    from goodput.report import report

    cuda = torch.cuda.is_available() and not args.cpu
    preset = PRESETS[args.preset or ("1b" if cuda else "tiny")]
    root = Path(args.root or tempfile.mkdtemp(prefix="goodput-"))
    root.mkdir(parents=True, exist_ok=True)
    fd, init = tempfile.mkstemp(prefix="goodput-pg-")
    os.close(fd)
    os.unlink(init)
    dist.init_process_group(
        "cpu:gloo,cuda:nccl" if cuda else "gloo", init_method=f"file://{init}", rank=0, world_size=1
    )
    daemon, watch = None, None
    raw: dict = {"meta": {}, "base": [], "runs": {}, "export_intervals": [], "publish_intervals": []}
    raw |= {"published": [], "errors": []}

    def keep() -> None:  # after every run: a run cut short still leaves what it measured
        if watch is not None:  # copies: the watch thread appends to its lists
            raw["export_intervals"] = list(watch.intervals["export"])
            raw["publish_intervals"] = list(watch.intervals["publish"])
        if args.json:
            Path(args.json).write_text(json.dumps(raw, indent=1))

    try:
        model, optim, x = build(preset, cuda)
        for _ in range(3):
            train_step(model, optim, x, None, False).item()
        nbytes = state_bytes(model, optim)
        say(f"model built and warm: {nbytes / 1e9:.2f} GB per save")
        floors = [disk_floor(root, nbytes)]
        from memory_probes import pinned_peak

        peak = pinned_peak(min(nbytes, 2 << 30))
        say(f"disk floor {floors[0]:.2f} s, pinned peak {peak} GB/s")
        patch = gm.torch_stager_closes_after_each_save()
        variant = args.copy_variant
        if variant is not None:
            import bench_copy_pacing

            found = Path(variant[5:]) if variant.startswith("best:") else None
            if found is not None:  # no file: the pacing bench did not finish, the library's own way
                variant = json.loads(found.read_text())["best"] if found.is_file() else None
            if variant is not None:
                bench_copy_pacing.apply(variant)
            say(f"stagerd's host copy issued as: {variant or 'the library default'}")
        raw["meta"] = {
            "device": torch.cuda.get_device_name(0) if cuda else f"CPU ({os.cpu_count()} cores)",
            "torch": torch.__version__,
            "python": platform.python_version(),
            "preset": preset,
            "params": sum(p.numel() for p in model.parameters()),
            "bytes_per_save": nbytes,
            "disk_floors": floors,
            "pinned_peak_gbs": peak,
            "torch_close_patched": patch,
            "long": args.long,
            "short": args.short,
            "threads": args.threads,
            "copy_variant": variant,
        }
        stagerd_root, sink = root / "stagerd", root / "sink"
        stagerd_root.mkdir(exist_ok=True)
        watch = DaemonWatch(stagerd_root, sink)
        watch.start()
        if not args.no_daemon:
            daemon = start_daemon(stagerd_root, sink, root / "daemon.log")
        ours = gm.StagerdMethod(model, optim, stagerd_root, args.threads)
        # Unhidden saves go to a root no daemon watches: their time to durable is the write's alone.
        runs = set(args.runs.split(","))
        alone = (
            gm.StagerdMethod(model, optim, root / "stagerd-alone", args.threads)
            if "unhidden" in runs
            else ours
        )
        best = gm.TorchBest(model, optim, root, args.threads, patch_close=patch)

        windows = Adjacent(
            args.adjacent_steps,
            lambda n: run(model, optim, x, None, k=n, saves=0, hidden=True, step0=0, warm=args.warm_steps),
        )

        def measure(key: str, m, k: int, saves: int, hidden: bool, step0: int = 0) -> None:
            adjacent = windows.before() if m is not None else None
            try:
                warm = args.warm_steps if m is None else 0  # a method's run follows its before-window
                r = run(model, optim, x, m, k=k, saves=saves, hidden=hidden, step0=step0, warm=warm)
            except Exception as e:  # the other methods still run; the error is in the report
                say(f"{key} failed: {type(e).__name__}: {e}")
                raw["errors"].append(f"{key}: {type(e).__name__}: {e}")
                return
            if m is None:
                raw["base"].append(r["times"])
                windows.took(r)
            else:
                raw["runs"][key] = {"k": k, **r} | ({"adjacent": adjacent} if adjacent else {})
            if m is ours and daemon is not None and r["saves"]:
                waited = settle_daemon(stagerd_root, sink, r["saves"][-1]["step"])
                say(f"the daemon's backlog settled in {waited:.1f} s")
            keep()

        measure("none", None, args.base_steps, 0, True)
        plan = [
            ("long", args.long, args.saves, True),
            ("short", args.short, args.saves, True),
            ("unhidden", args.long, max(3, args.saves - 1), False),
        ]
        plan = [p for p in plan if p[0] in runs]
        for n, (label, k, saves, hidden) in enumerate(plan):
            for m in (alone if label == "unhidden" else ours, best):
                measure(f"{m.name}|{label}", m, k, saves, hidden, 100_000 * (n + 1))
        windows.interrupt()
        for m in {id(m): m for m in (ours, alone, best)}.values():
            m.close()
        floors.append(disk_floor(root, nbytes))
        for cls in (gm.TorchAsyncDefault, gm.TorchSave) if "slow" in runs else ():
            slow = cls(model, optim, root, args.threads)
            measure(f"{slow.name}|long", slow, args.long, args.slow_saves, True)
            slow.close()
        measure("none", None, args.base_steps, 0, True)
        watch.stop.set()
        watch.join()
        raw["published"] = sorted(p.name for p in sink.glob("step-*")) if sink.exists() else []
        raw["meta"]["load_avg"] = os.getloadavg()
        keep()
        print(report(raw))
    finally:
        if daemon is not None:
            daemon.terminate()
            daemon.wait(timeout=120)
        dist.destroy_process_group()
        if args.root is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
