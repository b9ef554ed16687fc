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
(the save's K-step window against K baseline steps; first save apart), time to durable (save until the
marker or torch's upload future) against the disk floor (the same bytes written sequentially with one
`write` stream and fsynced, measured in the same run), the D2H rate of unhidden saves against one large
pinned copy, and the step time while the daemon exports. `--json FILE` keeps everything.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

PRESETS = {
    "tiny": {"hidden": 128, "layers": 2, "inter": 344, "heads": 4, "vocab": 2048, "seq": 128, "batch": 4},
    "small": {"hidden": 512, "layers": 4, "inter": 1376, "heads": 8, "vocab": 8192, "seq": 256, "batch": 4},
    "1b": {"hidden": 2048, "layers": 16, "inter": 5632, "heads": 16, "vocab": 32000, "seq": 2048, "batch": 8},
}


T0 = time.perf_counter()


def say(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f} s] {msg}", file=sys.stderr, flush=True)


def build(preset: dict, cuda: bool):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        hidden_size=preset["hidden"],
        num_hidden_layers=preset["layers"],
        intermediate_size=preset["inter"],
        num_attention_heads=preset["heads"],
        num_key_value_heads=preset["heads"],
        vocab_size=preset["vocab"],
        max_position_embeddings=preset["seq"],
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    device = torch.device("cuda" if cuda else "cpu")
    with device:
        model = LlamaForCausalLM(cfg).to(torch.bfloat16 if cuda else torch.float32)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=cuda)
    x = torch.randint(0, preset["vocab"], (preset["batch"], preset["seq"]), device=device)
    return model, optim, x


def train_step(model, optim, x, method, hidden: bool) -> float:
    loss = model(input_ids=x, labels=x).loss
    loss.backward()
    if method is not None and hidden:
        method.before_step()
    optim.step()
    optim.zero_grad(set_to_none=True)
    return loss


def state_bytes(model, optim) -> int:
    import torch

    n = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    for st in optim.state.values():
        n += sum(t.numel() * t.element_size() for t in st.values() if isinstance(t, torch.Tensor))
    return n


def disk_floor(root: Path, nbytes: int) -> float:
    """Seconds to write `nbytes` sequentially (64 MiB writes) and fsync them: the disk's floor."""
    chunk = os.urandom(1 << 20) * 64
    path = root / "disk-floor.bin"
    os.sync()
    t0 = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        left = nbytes
        while left > 0:
            left -= f.write(memoryview(chunk)[: min(left, len(chunk))])
        os.fsync(f.fileno())
    took = time.perf_counter() - t0
    path.unlink()
    return took


class ExportWatch(threading.Thread):
    """Polls ROOT for a step being exported (`export.tmp/`): the intervals the daemon was exporting."""

    def __init__(self, root: Path) -> None:
        super().__init__(daemon=True)
        self.root, self.stop, self.intervals, self._since = root, threading.Event(), [], None

    def run(self) -> None:
        while not self.stop.is_set():
            busy = any(self.root.glob("step-*/export.tmp"))
            now = time.perf_counter()
            if busy and self._since is None:
                self._since = now
            elif not busy and self._since is not None:
                self.intervals.append((self._since, now))
                self._since = None
            time.sleep(0.05)

    def busy(self, a: float, b: float) -> bool:
        return any(s < b and a < e for s, e in self.intervals)


def run(model, optim, x, method, *, k: int, saves: int, hidden: bool, step0: int) -> dict:
    """K * (saves + 1) steps, a save at the end of every K-th; per step its start and duration."""
    if method is not None:
        method.saves = []
    times, starts = [], []
    for i in range(1, k * (saves + 1) + 1):
        t0 = time.perf_counter()
        loss = train_step(model, optim, x, method, hidden)
        if method is not None and i % k == 0 and i <= k * saves:
            if not hidden:  # off the stall's clock: what the loop queued, so the stall is the copy alone
                _sync_device()
            method.save(step0 + i)
            if not hidden:
                method.settle()
        loss.item()
        starts.append(t0)
        times.append(time.perf_counter() - t0)
    if method is not None:
        method.before_step()
        method.drain()
        time.sleep(0.5)  # the done-callbacks have run; the disk settles
    say(
        f"{method.name if method else 'no saves'}: K={k}, {saves} saves, {'hidden' if hidden else 'unhidden'}"
    )
    return {
        "times": times,
        "starts": starts,
        "saves": [dataclasses.asdict(r) for r in method.saves] if method else [],
    }


def _sync_device() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def settle_daemon(root: Path, sink: Path, step: int, timeout: float = 120.0) -> float:
    """Wait until the daemon has published `step` and exports nothing: its backlog is not left to slow the
    next method's run, which it has nothing to do with. Seconds waited."""
    from stagerd.contract.layout import step_dir_name

    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        if (sink / step_dir_name(step)).is_dir() and not any(root.glob("step-*/export.tmp")):
            break
        time.sleep(0.1)
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default=None, help="default: 1b with CUDA, else tiny")
    p.add_argument("--cpu", action="store_true", help="ignore CUDA")
    p.add_argument("--long", type=int, default=20, help="steps between saves, longer than a write")
    p.add_argument("--short", type=int, default=4, help="steps between saves, shorter than a write")
    p.add_argument("--saves", type=int, default=4, help="saves per run (the first is reported apart)")
    p.add_argument("--slow-saves", type=int, default=2, help="saves of the blocking torch methods")
    p.add_argument("--base-steps", type=int, default=30, help="steps without saves, before and after")
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
        from report_goodput import report

        print(report(json.loads(Path(args.report).read_text())))
        return
    import goodput_methods as gm
    import torch
    import torch.distributed as dist
    from report_goodput import report

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
    daemon = None
    raw: dict = {"meta": {}, "base": [], "runs": {}, "export_intervals": [], "published": [], "errors": []}

    def keep() -> None:  # after every run: a run cut short still leaves what it measured
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
        watch = ExportWatch(stagerd_root)
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

        def measure(key: str, m, k: int, saves: int, hidden: bool, step0: int = 0) -> None:
            try:
                r = run(model, optim, x, m, k=k, saves=saves, hidden=hidden, step0=step0)
            except Exception as e:  # the other methods still run; the error is in the report
                say(f"{key} failed: {type(e).__name__}: {e}")
                raw["errors"].append(f"{key}: {type(e).__name__}: {e}")
                return
            if m is None:
                raw["base"].append(r["times"])
            else:
                raw["runs"][key] = {"k": k, **r}
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
        for m in {id(m): m for m in (ours, alone, best)}.values():
            m.close()
        floors.append(disk_floor(root, nbytes))
        for cls in (gm.TorchAsyncDefault, gm.TorchSave) if "slow" in runs else ():
            m = cls(model, optim, root, args.threads)
            measure(f"{m.name}|long", m, args.long, args.slow_saves, True)
            m.close()
        measure("none", None, args.base_steps, 0, True)
        watch.stop.set()
        raw["export_intervals"] = watch.intervals
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


def start_daemon(root: Path, sink: Path, log: Path) -> subprocess.Popen:
    """`stagerd watch ROOT --sink file://SINK --keep-last 1`, as a node would run it beside training."""
    here = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([here, os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "stagerd.cli", "watch", str(root), "--sink", sink.as_uri()]
    cmd += ["--keep-last", "1", "--remote-keep-last", "1", "--metrics-port", "0", "--grace-seconds", "5"]
    return subprocess.Popen(
        cmd, env=env, stdout=subprocess.DEVNULL, stderr=open(log, "wb"), preexec_fn=_die_with_parent
    )


def _die_with_parent() -> None:
    """The daemon gets SIGTERM when the bench dies, however it dies (prctl PR_SET_PDEATHSIG)."""
    import ctypes
    import signal

    ctypes.CDLL("libc.so.6").prctl(1, signal.SIGTERM)


if __name__ == "__main__":
    main()
