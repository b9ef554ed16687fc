"""Adopting a torchtitan-format checkpoint: `stagerd consolidate --adopt` vs torch's `dcp_to_torch_save` +
`safetensors.torch.save_file`, same checkpoint, paired interleaved rounds.

The checkpoint is what torchtitan's CheckpointManager writes for a Llama (its names, fp32), saved by real
gloo ranks with DCP's FileSystemWriter: every weight `Shard(0)` over the ranks as FSDP2 shards it, plus
AdamW's `exp_avg` and `exp_avg_sq` under `optimizer.` (so the files hold 3x the model's bytes, as a
training checkpoint does). Each tool runs in its own subprocess; wall time and that child's peak RSS come
from `wait4`. Rows:

- torch: `dcp_to_torch_save` (loads the whole checkpoint, optimizer included, then pickles it), `torch.load`,
  keep the model's keys, `save_file` (the recipe torch's docs give for DCP -> safetensors; not fsynced);
- stagerd, same names: `consolidate --adopt dcp --adopt-select <model keys>` (the same tensors and bytes
  as torch's row, fsynced);
- stagerd, torchtitan preset: `consolidate --adopt torchtitan` (HF names, q/k rows in HF's RoPE order);
- `cp -r` of the whole checkpoint, for the disk's copy speed (GB/s over the bytes it copies).

    python bench/bench_adopt.py --model-gb 0.5 --rounds 3
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

ROOT = Path(__file__).resolve().parent.parent
HIDDEN, INTER, VOCAB = 1024, 2816, 32000
MODEL_KEYS = r"(?!(?:optimizer|lr_scheduler|dataloader|train_state)(?:\.|$))(?P<name>.+)"


def shapes(model_bytes: float) -> dict[str, tuple[int, ...]]:
    h, i, kv = HIDDEN, INTER, HIDDEN // 4
    layer = {
        "attention.qkv_linear.wq.weight": (h, h),
        "attention.qkv_linear.wk.weight": (kv, h),
        "attention.qkv_linear.wv.weight": (kv, h),
        "attention.wo.weight": (h, h),
        "feed_forward.w1.weight": (i, h),
        "feed_forward.w2.weight": (h, i),
        "feed_forward.w3.weight": (i, h),
        "attention_norm.weight": (h,),
        "ffn_norm.weight": (h,),
    }
    per_layer = sum(4 * (a * (b[0] if b else 1)) for a, *b in layer.values())
    layers = max(1, int((model_bytes - 2 * 4 * VOCAB * h) // per_layer))
    out = {"tok_embeddings.weight": (VOCAB, h)}
    for n in range(layers):
        out.update({f"layers.{n}.{k}": v for k, v in layer.items()})
    out.update({"norm.weight": (h,), "lm_head.weight": (VOCAB, h)})
    return out


def _rank(rank: int, world: int, init: str, out: str, model_bytes: float) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(rank)
    sd: dict[str, object] = {}
    for name, shape in shapes(model_bytes).items():
        local = [shape[0] // world, *shape[1:]]
        for key in (name, f"optimizer.state.{name}.exp_avg", f"optimizer.state.{name}.exp_avg_sq"):
            t = torch.randn(local, generator=g)
            sd[key] = DTensor.from_local(t, mesh, [Shard(0)], run_check=False)
    sd["train_state"] = {"step": 100}
    dcp.save(sd, checkpoint_id=out)
    dist.destroy_process_group()


def generate(out: Path, model_gb: float, world: int) -> None:
    code = (
        "import sys, tempfile, os; sys.path.insert(0, sys.argv[1]); import torch.multiprocessing as mp; "
        "from bench.bench_adopt import _rank; fd, init = tempfile.mkstemp(); os.close(fd); os.unlink(init); "
        "mp.spawn(_rank, args=(int(sys.argv[4]), init, sys.argv[2], float(sys.argv[3]) * 1e9), "
        "nprocs=int(sys.argv[4]))"
    )
    subprocess.run([sys.executable, "-c", code, str(ROOT), str(out), str(model_gb), str(world)], check=True)


PEER = """
import sys, re, torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from safetensors.torch import save_file
ckpt, tmp, out = sys.argv[1:4]
dcp_to_torch_save(ckpt, tmp)
sd = torch.load(tmp, weights_only=True)
rx = re.compile(sys.argv[4])
save_file({k: v for k, v in sd.items() if isinstance(v, torch.Tensor) and rx.fullmatch(k)}, out)
"""


def timed(cmd: list[str]) -> tuple[float, float]:
    """(wall seconds, peak RSS MiB) of one child."""
    t0 = time.monotonic()
    proc = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}
    )
    _, status, usage = os.wait4(proc.pid, 0)
    if status != 0:
        raise SystemExit(f"{cmd[:4]} failed: {status}")
    return time.monotonic() - t0, usage.ru_maxrss / 1024


def du(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-gb", type=float, default=0.5)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--work", type=Path, default=None)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="stagerd-bench-adopt-", dir=args.work))
    ckpt = work / "checkpoint" / "step-100"
    try:
        generate(ckpt, args.model_gb, args.ranks)
        (work / "checkpoint" / "config.json").write_text(
            json.dumps({"model_type": "llama", "num_attention_heads": HIDDEN // 64, "num_key_value_heads": 4})
        )
        model = 4 * sum(a * (b[0] if b else 1) for a, *b in shapes(args.model_gb * 1e9).values())
        stagerd = [sys.executable, "-m", "stagerd.cli", "consolidate", str(ckpt)]
        threads = ["--threads", str(args.threads)]
        tools = {
            "torch dcp_to_torch_save + save_file": lambda o: [
                *(sys.executable, "-c", PEER, str(ckpt)), str(o / "t.pt"), str(o / "m.st"), MODEL_KEYS
            ],
            "stagerd consolidate --adopt (same names)": lambda o: [
                *stagerd, str(o / "x"), "--adopt", "dcp", "--adopt-select", MODEL_KEYS, *threads
            ],
            "stagerd consolidate --adopt torchtitan (HF names, RoPE rows)": lambda o: [
                *stagerd, str(o / "x"), "--adopt", "torchtitan", *threads
            ],
            "cp -r (whole checkpoint)": lambda o: ["cp", "-r", str(ckpt), str(o / "x")],
        }  # fmt: skip
        runs: dict[str, list[tuple[float, float]]] = {k: [] for k in tools}
        checked = False
        for _ in range(args.rounds):
            for name, cmd in tools.items():
                out = work / "out"
                shutil.rmtree(out, ignore_errors=True)
                out.mkdir()
                subprocess.run(["sync"], check=True)
                runs[name].append(timed(cmd(out)))
                if not checked and name.startswith("stagerd consolidate --adopt (same"):
                    checked = True
                    _check_same(work, out)
                shutil.rmtree(out)
        load = os.getloadavg()
        print(
            f"\nmodel {model / 1e9:.2f} GB fp32 of a {du(ckpt) / 1e9:.2f} GB checkpoint ({args.ranks} ranks),"
            " "
            f"{args.rounds} interleaved rounds, load average {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}\n"
        )
        print("| tool | median s | min-max s | model GB/s | peak RSS MiB | torch / this |")
        print("|---|---|---|---|---|---|")
        peer = statistics.median(w for w, _ in runs["torch dcp_to_torch_save + save_file"])
        for name, rs in runs.items():
            walls = [w for w, _ in rs]
            med = statistics.median(walls)
            rss = max(r for _, r in rs)
            gbs = (du(ckpt) if name.startswith("cp") else model) / 1e9 / med
            print(f"| {name} | {med:.2f} | {min(walls):.2f}-{max(walls):.2f} | {gbs:.2f} | {rss:.0f} | "
                  f"{peer / med:.2f}x |")  # fmt: skip
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _check_same(work: Path, _out: Path) -> None:
    """Once: stagerd's same-name export holds torch's tensors, byte for byte."""
    import subprocess as sp

    peer_out = work / "peer_check"
    shutil.rmtree(peer_out, ignore_errors=True)
    peer_out.mkdir()
    ckpt = work / "checkpoint" / "step-100"
    sp.run([sys.executable, "-c", PEER, str(ckpt), str(peer_out / "full.pt"), str(peer_out / "m.safetensors"),
            MODEL_KEYS], check=True, cwd=ROOT)  # fmt: skip
    code = (
        "import sys, glob; from safetensors.numpy import load_file; a = load_file(sys.argv[1]); b = {}; "
        "[b.update(load_file(f)) for f in glob.glob(sys.argv[2] + '/*.safetensors')]; "
        "assert sorted(a) == sorted(b) and all(a[k].tobytes() == b[k].tobytes() for k in a), 'differ'"
    )
    sp.run([sys.executable, "-c", code, str(peer_out / "m.safetensors"), str(_out / "x")], check=True)
    shutil.rmtree(peer_out)
    print("same bytes: stagerd's export == torch's save_file output", flush=True)


if __name__ == "__main__":
    main()
