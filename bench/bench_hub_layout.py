"""Hub-layout export benchmark (issue 12): a MoE checkpoint whose experts are fused in memory
(`mlp.experts.gate_up_proj` [E, 2I, H], `down_proj` [E, H, I]), exported as staged (plain) and in the Hub
layout `save_pretrained` writes (`mlp.experts.{e}.gate_proj.weight` ...), same shards, same run.

The checkpoint is a Qwen3-MoE of about SIZE GB saved by 2 gloo ranks with DCP's HF writer (every tensor
`Shard(0)`, as FSDP2 shards). The to-Hub plan is resolved by the Stager's own code (`training/trace`) from the
model built on the meta device, so it is transformers' registry, not a table of ours. Each export is its
own process (wall time and peak RSS from wait4); rounds alternate which goes first; outputs are deleted
and `sync`ed between runs.

    python bench/bench_hub_layout.py --size-gb 2 --repeat 3 --threads 2
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


def config(size_gb: float):
    import transformers as tf

    hidden, inter, experts = 1024, 512, 64
    per_layer = experts * 3 * inter * hidden * 4 + 4 * hidden * hidden * 4
    layers = max(1, round(size_gb * 1e9 / per_layer))
    return tf.Qwen3MoeConfig(
        vocab_size=8192, hidden_size=hidden, intermediate_size=2048, moe_intermediate_size=inter,
        num_experts=experts, num_experts_per_tok=4, num_hidden_layers=layers, num_attention_heads=8,
        num_key_value_heads=4, head_dim=128, tie_word_embeddings=False,
    )  # fmt: skip


def meta_model(size_gb: float):
    import torch
    import transformers as tf

    with torch.device("meta"):
        return tf.AutoModelForCausalLM.from_config(config(size_gb))


def _rank(rank: int, world: int, init: str, out: str, size_gb: float) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(rank)
    sd = {}
    for name, t in meta_model(size_gb).state_dict().items():
        rows = t.shape[0] // world + (1 if rank < t.shape[0] % world else 0)
        local = torch.randn((rows, *t.shape[1:]), generator=g)
        sd[name] = DTensor.from_local(
            local, mesh, [Shard(0)], run_check=False, shape=t.shape, stride=t.stride()
        )
    dcp.save(sd, storage_writer=HuggingFaceStorageWriter(out, save_distributed=True))
    dist.destroy_process_group()


def generate(out: Path, size_gb: float) -> None:
    import torch.multiprocessing as mp

    init = tempfile.mktemp(prefix="stagerd-bench-")
    mp.start_processes(_rank, args=(2, init, str(out), size_gb), nprocs=2, start_method="spawn")


def write_plan(path: Path, size_gb: float) -> int:
    """The to-Hub plan the Stager records for this model (transformers' registry, traced on meta tensors)."""
    sys.path.insert(0, str(ROOT))  # this checkout's stagerd, as the children (cwd ROOT) import it
    from stagerd.training.trace.resolve import transformers_plan

    model = meta_model(size_gb)
    plan = transformers_plan(model, model.state_dict(), {})
    path.write_text(json.dumps(plan.to_json()))
    return len(plan.views)


EXPORT = """
import json, sys
from pathlib import Path
from stagerd.contract.hub_plan import HubPlan
from stagerd.engine.consolidate import consolidate_into
views = HubPlan.from_json(json.loads(Path(sys.argv[3]).read_text())) if sys.argv[3] != "-" else None
res = consolidate_into(Path(sys.argv[1]), Path(sys.argv[2]), views=views, threads=int(sys.argv[4]))
print(json.dumps({"tensors": res.tensors, "bytes": res.total_size, "files": len(res.files)}))
"""


def timed(cmd: list[str]) -> tuple[float, float, dict]:
    """(wall seconds, peak RSS MiB, what the export reported) of a child process."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    assert proc.stdout is not None
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"failed: {' '.join(cmd)}")
    return wall, usage.ru_maxrss / 1024, json.loads(out.strip().splitlines()[-1])


def spread(xs: list[float], digits: int = 2) -> str:
    return f"{statistics.median(xs):.{digits}f} | {min(xs):.{digits}f} | {max(xs):.{digits}f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gb", type=float, default=2.0)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--work", type=Path, help="working directory (default: a temporary one, removed)")
    ap.add_argument("--generate", nargs=2, metavar=("DIR", "SIZE_GB"), help=argparse.SUPPRESS)
    ap.add_argument("--plan", nargs=2, metavar=("FILE", "SIZE_GB"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.generate:
        generate(Path(a.generate[0]), float(a.generate[1]))
        return
    if a.plan:
        print(write_plan(Path(a.plan[0]), float(a.plan[1])))
        return
    work = a.work or Path(tempfile.mkdtemp(prefix="stagerd-bench-hub-"))
    src, out, plan = work / "shards", work / "out", work / "hub_plan.json"
    if not src.is_dir():
        subprocess.run(
            [sys.executable, __file__, "--generate", str(src), str(a.size_gb)], check=True, cwd=ROOT
        )
    # In a child, as the generation: a forked child's peak RSS starts at its parent's (torch, transformers).
    made = subprocess.run(
        [sys.executable, __file__, "--plan", str(plan), str(a.size_gb)],
        check=True,
        cwd=ROOT,
        capture_output=True,
    )
    views = int(made.stdout.split()[-1])
    runs = {"plain": "-", "hub layout": str(plan)}
    found: dict[str, list[tuple[float, float]]] = {name: [] for name in runs}
    reports: dict[str, dict] = {}
    for rnd in range(a.repeat):
        order = list(runs) if rnd % 2 == 0 else list(reversed(runs))
        for name in order:
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir(parents=True)
            subprocess.run(["sync"], check=True)
            wall, rss, reports[name] = timed(
                [sys.executable, "-c", EXPORT, str(src), str(out), runs[name], str(a.threads)]
            )
            found[name].append((wall, rss))
            print(f"round {rnd + 1} {name:12s} {wall:7.2f} s {rss:7.0f} MiB {reports[name]}", flush=True)
    ratios = [h[0] / p[0] for p, h in zip(found["plain"], found["hub layout"], strict=True)]
    print(f"\nsource: {sum(f.stat().st_size for f in src.iterdir()) / 1e9:.2f} GB in shards, {views} views")
    print("| export | median s | min s | max s | peak RSS MiB, median | min | max | tensors |")
    print("|---|---|---|---|---|---|---|---|")
    for name, xs in found.items():
        walls, rss = [w for w, _ in xs], [r for _, r in xs]
        print(f"| {name} | {spread(walls)} | {spread(rss, 0)} | {reports[name]['tensors']} |")
    med, lo, hi = statistics.median(ratios), min(ratios), max(ratios)
    print(f"\nhub / plain, paired by round: {med:.3f}x ({lo:.3f}x-{hi:.3f}x)")
    if a.work is None:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
