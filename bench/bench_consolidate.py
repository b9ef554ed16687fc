"""Export engine benchmark: `stagerd consolidate` vs torch's consolidation vs `cp -r`, same files, one run.

Generates a DCP checkpoint (fp32, `Shard(0)` plus a `Shard(1)` share, RANKS ranks x FILES files each; with
`--mixed`, a quarter each bf16 and fp16, and on 4+ ranks a quarter 2-D blocks) with real gloo processes,
then times each tool in a subprocess (wall time and that child's peak RSS via wait4). Every output is
deleted and `sync`ed between runs so each starts from the same warm page cache. The keep export and the
`--dtype bf16`, `fp16` and `fp32` exports of one round run back to back, so each cast / keep ratio is a
paired figure.

    python bench/bench_consolidate.py --size-gb 6 --ranks 4 --files 4 --threads 2
    python bench/bench_consolidate.py --size-gb 1 --ranks 2 --files 2 --mixed   # cast / keep pairs
    python bench/bench_consolidate.py --many-tensors 100000 --ranks 2 --files 4 --keep   # memory flat in
        # tensor count: peak RSS of plan, export (keep and every cast) and verify; plan bytes per tensor;
        # torch's consolidation right before the keep export in every round (keep / torch paired)
    python bench/bench_consolidate.py --bar --size-gb 3.3 --ranks 4 --files 2 --mixed --repeat 5
        # the casts right after a keep export, as a daemon runs them (bench/consolidate_bar.py)
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
sys.path.insert(0, str(ROOT / "bench"))


def _rank(rank: int, world: int, init: str, out: str, size: int, files: int, mixed: bool, many: int) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    hidden = 64 if many else 4096
    n_tensors = many or max(files * 2, size // (hidden * hidden * 4))
    rows = 8 * world if many else size // (n_tensors * hidden * 4) // world * world  # even split
    dtypes = [torch.float32, torch.float32, torch.bfloat16, torch.float16] if mixed else [torch.float32]
    g = torch.Generator().manual_seed(rank)
    sd = {}
    # with 4+ ranks and --mixed, every 4th tensor is a 2-D block (Shard(0) x Shard(1), as FSDP x TP)
    mesh2 = init_device_mesh("cpu", (2, world // 2)) if mixed and world >= 4 and world % 2 == 0 else None
    for i in range(n_tensors):
        # every 4th tensor column-sharded, like a row-parallel projection
        dim = 1 if i % 4 == 3 else 0
        shape = [rows, hidden]
        local_shape = list(shape)
        local_shape[dim] //= world
        on, placements = mesh, [Shard(dim)]
        if mesh2 is not None and i % 4 == 1:
            local_shape, on, placements = [rows // 2, hidden // (world // 2)], mesh2, [Shard(0), Shard(1)]
        local = torch.randn(local_shape, generator=g).to(dtypes[i % len(dtypes)])
        name = f"model.layers.{i // 256}.mlp.experts.{i % 256}.weight" if many else f"model.layers.{i}.weight"
        sd[name] = DTensor.from_local(
            local, on, placements, run_check=False, shape=torch.Size(shape), stride=(hidden, 1)
        )
    mapping = {k: 1 + i * files // len(sd) for i, k in enumerate(sorted(sd))}
    dcp.save(
        sd, storage_writer=HuggingFaceStorageWriter(out, save_distributed=True, fqn_to_index_mapping=mapping)
    )
    dist.destroy_process_group()
    if rank == 0:
        Path(out, "mapping.json").write_text(json.dumps(mapping))


def _generate_here(out: Path, size_gb: float, ranks: int, files: int, mixed: bool, many: int) -> None:
    import torch.multiprocessing as mp

    init = tempfile.mktemp(prefix="stagerd-bench-")
    mp.start_processes(
        _rank,
        args=(ranks, init, str(out), int(size_gb * 1e9), files, mixed, many),
        nprocs=ranks,
        start_method="spawn",
    )


def generate(out: Path, size_gb: float, ranks: int, files: int, mixed: bool, many: int) -> dict[str, int]:
    """Save in a child process: the parent must stay small, since a forked child's peak RSS starts at ours."""
    cmd = [sys.executable, __file__, "--generate", str(out), str(size_gb), str(ranks), str(files)]
    cmd += [str(int(mixed)), str(many)]
    subprocess.run(cmd, check=True, cwd=ROOT)
    mapping = json.loads((out / "mapping.json").read_text())
    (out / "mapping.json").unlink()
    return mapping


def timed(cmd: list[str], env: dict | None = None) -> tuple[float, float, float]:
    """(wall seconds, peak RSS MiB, CPU seconds: user + system) of a child process."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"failed: {' '.join(cmd)}")
    return wall, usage.ru_maxrss / 1024, usage.ru_utime + usage.ru_stime


def du(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


TORCH_CONSOLIDATE = """
import json, os, sys
os.makedirs(sys.argv[2], exist_ok=True)
from torch.distributed.checkpoint._consolidate_hf_safetensors import consolidate_safetensors_files
consolidate_safetensors_files(sys.argv[1], sys.argv[2], fqn_to_index_mapping=json.load(open(sys.argv[3])),
                              num_threads=int(sys.argv[4]))
"""

# torch has no cast option: the peer for --dtype bf16 is its consolidation plus a separate cast pass.
TORCH_CAST_PASS = """
import sys, pathlib, torch
from safetensors import safe_open
from safetensors.torch import save_file
for f in sorted(pathlib.Path(sys.argv[1]).glob("*.safetensors")):
    with safe_open(f, "pt") as r:
        out = {k: r.get_tensor(k).to(torch.bfloat16) for k in r.keys()}
    save_file(out, str(f) + ".bf16", metadata={"format": "pt"})
    del out
    f.unlink()
"""


# Per-tensor memory of the plan: the resident and traced growth from planning, over the tensor count.
PLAN_MEMORY = """
import gc, resource, sys, json, tracemalloc
from pathlib import Path
from stagerd.engine.consolidate import plan, scan_shards
from stagerd.engine.moves import plan_moves
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096
gc.collect(); r0 = rss()
tracemalloc.start(); t0 = tracemalloc.get_traced_memory()[0]
p = plan(scan_shards(Path(sys.argv[1])))
gc.collect(); r1 = rss(); kept, traced_peak = tracemalloc.get_traced_memory(); tracemalloc.stop()
n = p.tensor_count
moves = sum(1 for _ in plan_moves(p))
print(json.dumps({"tensors": n, "moves": moves, "files": len(p.files),
                  "plan_bytes_per_tensor": (kept - t0) / n, "plan_rss_bytes_per_tensor": (r1 - r0) / n,
                  "traced_peak_mib": (traced_peak - t0) / 2**20,
                  "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""

# Planning alone, as its own process: the peak RSS of `plan()` with nothing else loaded.
PLAN_ONLY = """
import sys
from pathlib import Path
from stagerd.engine.consolidate import plan, scan_shards
plan(scan_shards(Path(sys.argv[1]))).index()
"""

CASTS = ("bf16", "fp16", "fp32")


def spread(xs: list[float], digits: int = 2) -> str:
    return f"{statistics.median(xs):.{digits}f} | {min(xs):.{digits}f} | {max(xs):.{digits}f}"


def many_tensors(src: Path, work: Path, threads: int, repeat: int) -> dict[str, object]:
    """Plan, export (keep and every cast) and verify a checkpoint of many small tensors: time and peak
    RSS, each in its own process; every round runs the casts right after the keep export (paired)."""
    out = work / "out"
    stagerd = [sys.executable, "-m", "stagerd.cli"]
    keep = [*stagerd, "consolidate", str(src), str(out), "--threads", str(threads)]
    runs: dict[str, list[str]] = {
        "stagerd plan (alone)": [sys.executable, "-c", PLAN_ONLY, str(src)],
        "stagerd consolidate": keep,
        **{f"stagerd consolidate --dtype {c}": [*keep, "--dtype", c] for c in CASTS},
        "torch consolidate_safetensors_files": [
            sys.executable,
            "-c",
            TORCH_CONSOLIDATE,
            str(src),
            str(out),
            str(work / "mapping.json"),
            str(threads),
        ],
    }
    found: dict[str, list[tuple[float, float, float]]] = {
        name: [] for name in [*runs, "stagerd verify --against"]
    }
    load = [os.getloadavg()[0]]
    for _ in range(repeat):
        # torch right before the keep export in every round: keep / torch is a paired figure
        for name in ["torch consolidate_safetensors_files", *(n for n in runs if not n.startswith("torch"))]:
            cmd = runs[name]
            shutil.rmtree(out, ignore_errors=True)
            subprocess.run(["sync"], check=True)
            found[name].append(timed(cmd))
            if name == "stagerd consolidate":
                verify = [*stagerd, "verify", "--against", str(src), "--threads", str(threads), str(out)]
                found["stagerd verify --against"].append(timed(verify))
            wall, peak = found[name][-1][:2]
            print(f"round {len(found[name])} {name:40s} {wall:7.2f} s {peak:7.0f} MiB", flush=True)
            load.append(os.getloadavg()[0])
    shutil.rmtree(out, ignore_errors=True)
    mem = json.loads(
        subprocess.run(
            [sys.executable, "-c", PLAN_MEMORY, str(src)],
            check=True,
            capture_output=True,
            text=True,
            cwd=ROOT,
        ).stdout
    )
    print("\n| tool | median s | min s | max s | peak RSS MiB, median | min | max |")
    print("|---|---|---|---|---|---|---|")
    for name, got in found.items():
        print(f"| {name} | {spread([g[0] for g in got])} | {spread([g[1] for g in got], 0)} |")
    print()
    for c in CASTS:
        print_pairs(
            c,
            [g[0] for g in found[f"stagerd consolidate --dtype {c}"]],
            [g[0] for g in found["stagerd consolidate"]],
        )
    pairs = sorted(
        k[0] / t[0]
        for k, t in zip(
            found["stagerd consolidate"], found["torch consolidate_safetensors_files"], strict=True
        )
    )
    print(
        f"stagerd consolidate (keep) / torch, paired by round: median {statistics.median(pairs):.2f}x "
        f"(range {pairs[0]:.2f}x - {pairs[-1]:.2f}x over {len(pairs)} rounds)"
    )
    print(f"\n{repeat} interleaved rounds, load average {min(load):.1f}-{max(load):.1f} during the run")
    print(
        f"plan: {mem['tensors']} tensors, {mem['files']} files, {mem['moves']} moves; "
        f"{mem['plan_bytes_per_tensor']:.0f} B/tensor kept (tracemalloc), "
        f"{mem['plan_rss_bytes_per_tensor']:.0f} B/tensor of RSS growth, "
        f"traced peak {mem['traced_peak_mib']:.0f} MiB, process peak {mem['peak_mib']:.0f} MiB"
    )
    return {"runs": found, "plan_memory": mem}


def print_pairs(
    cast: str, cast_walls: list[float], keep_walls: list[float], per_byte: float = 1.0, what: str = ""
) -> None:
    """Cast over keep, paired by round (each cast ran right after its round's keep export); with
    `per_byte` (the cast's output bytes over keep's), also per output byte."""
    pairs = sorted(c / k for c, k in zip(cast_walls, keep_walls, strict=True))
    line = (
        f"cast {cast} / keep{what}, paired by round: median {statistics.median(pairs):.2f}x "
        f"(range {pairs[0]:.2f}x - {pairs[-1]:.2f}x over {len(pairs)} rounds)"
    )
    if per_byte != 1.0:
        line += (
            f"; per output byte ({per_byte:.2f}x keep's bytes): {statistics.median(pairs) / per_byte:.2f}x"
        )
    print(line)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size-gb", type=float, default=6.0)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--files", type=int, default=4, help="output files (and files per rank)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--work", type=Path, default=ROOT / "bench" / "data")
    ap.add_argument("--skip-cast", action="store_true")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--keep", action="store_true", help="keep the generated shards")
    ap.add_argument("--repeat", type=int, default=3, help="interleaved rounds per tool (median reported)")
    ap.add_argument("--shards", type=Path, help="reuse shards made by an earlier --keep run")
    ap.add_argument("--mixed", action="store_true", help="a quarter each of the tensors bf16 and fp16")
    ap.add_argument("--numpy-casts", action="store_true", help="also each cast without the F16C kernel")
    ap.add_argument("--many-tensors", type=int, default=0, help="N small [8*ranks, 64] tensors instead")
    ap.add_argument("--bar", action="store_true", help="keep, then bf16, then fp16, as a daemon runs them")
    ap.add_argument("--compare", type=Path, help="with --bar: also run another checkout's code, paired")
    args = ap.parse_args()

    work = args.work / (f"many-{args.many_tensors}" if args.many_tensors else f"consolidate-{args.size_gb}g")
    t0 = time.perf_counter()
    if args.shards:  # shards and mapping.json from an earlier --keep run
        work, src, args.keep = args.shards.parent, args.shards, True
        mapping = json.loads((work / "mapping.json").read_text())
    else:
        shutil.rmtree(work, ignore_errors=True)
        src = work / "shards"
        mapping = generate(src, args.size_gb, args.ranks, args.files, args.mixed, args.many_tensors)
    size = du(src)
    n_shards = len(list(src.iterdir()))
    print(f"generated {size / 1e9:.2f} GB in {n_shards} shards in {time.perf_counter() - t0:.1f} s")
    (work / "mapping.json").write_text(json.dumps(mapping))
    (work / "ref.json").write_text(json.dumps({"weight_map": {k: f"f{v}" for k, v in mapping.items()}}))
    if args.bar:
        from consolidate_bar import bar

        bar(src, work, args.repeat, args.threads, ROOT, args.compare)
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        return
    if args.many_tensors:
        results = many_tensors(src, work, args.threads, args.repeat)
        if args.json:
            args.json.write_text(json.dumps({"size": size, **results}, indent=1))
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        return
    stagerd = [sys.executable, "-m", "stagerd.cli", "consolidate", str(src)]
    out = work / "out"

    def clean() -> None:
        shutil.rmtree(out, ignore_errors=True)
        subprocess.run(["sync"], check=True)

    keep_cmd = [
        *stagerd,
        str(out),
        "--threads",
        str(args.threads),
        "--reference-index",
        str(work / "ref.json"),
    ]
    torch_cmd = [sys.executable, "-c", TORCH_CONSOLIDATE, str(src), str(out), str(work / "mapping.json")]
    runs: dict[str, list[str] | None] = {
        "cp -r": ["cp", "-r", str(src), str(out)],
        "cp -r && sync": ["sh", "-c", f"cp -r {src} {out} && sync"],
        "stagerd consolidate": keep_cmd,
        "torch consolidate_safetensors_files": [
            sys.executable,
            "-c",
            TORCH_CONSOLIDATE,
            str(src),
            str(out),
            str(work / "mapping.json"),
            str(args.threads),
        ],
    }
    if not args.skip_cast:
        for c in CASTS:
            runs[f"stagerd consolidate --dtype {c}"] = [*keep_cmd, "--dtype", c]
        for c in CASTS if args.numpy_casts else ():  # the same casts without the F16C kernel: before/after
            runs[f"stagerd consolidate --dtype {c} (numpy)"] = [
                "env",
                "STAGERD_NO_HALFCAST=1",
                *keep_cmd,
                "--dtype",
                c,
            ]
        runs["torch consolidate + cast pass"] = None  # two steps, timed together below
    clean()
    subprocess.run(["cp", "-r", str(src), str(out)], check=True)  # warm the page cache with the source
    # Rounds interleave the tools so each sees the same conditions; the median is the reported figure.
    walls: dict[str, list[float]] = {name: [] for name in runs}
    rss: dict[str, float] = dict.fromkeys(runs, 0.0)
    written: dict[str, int] = dict.fromkeys(runs, 0)
    cpus: dict[str, list[float]] = {name: [] for name in runs}
    for rnd in range(args.repeat):
        for name, cmd in runs.items():
            if rnd and name.startswith("torch consolidate +"):
                continue  # slow and far from the others; one round is enough to rank it
            clean()
            if cmd is not None:
                wall, peak, cpu = timed(cmd)
            else:
                w1, r1, c1 = timed([*torch_cmd, str(args.threads)])
                w2, r2, c2 = timed([sys.executable, "-c", TORCH_CAST_PASS, str(out)])
                wall, peak, cpu = w1 + w2, max(r1, r2), c1 + c2
            walls[name].append(wall)
            cpus[name].append(cpu)
            rss[name] = max(rss[name], peak)
            written[name] = du(out)
            print(
                f"round {rnd + 1} {name:40s} {wall:7.2f} s  {size / 1e9 / wall:5.2f} GB/s  {peak:7.0f} MiB",
                flush=True,
            )
    clean()
    med = {name: statistics.median(w) for name, w in walls.items()}
    cp, torch_t = med["cp -r"], med["torch consolidate_safetensors_files"]
    print()
    print(
        f"checkpoint: {size / 1e9:.2f} GB {'mixed' if args.mixed else 'fp32'}, {args.ranks} ranks, "
        f"{len(list(src.iterdir()))} shards, "
        f"{args.files} output files, {args.threads} threads, {os.cpu_count()} cores, "
        f"median of {args.repeat} interleaved rounds, load average {os.getloadavg()[0]:.1f} at the end"
    )
    print()
    print(
        "| tool | median s | min s | max s | CPU s, median | GB/s | peak RSS MiB | vs cp -r "
        "| vs cp -r && sync | torch / this |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, w in walls.items():
        m = med[name]
        print(
            f"| {name} | {m:.2f} | {min(w):.2f} | {max(w):.2f} | {statistics.median(cpus[name]):.2f} "
            f"| {size / 1e9 / m:.2f} | {rss[name]:.0f} "
            f"| {m / cp:.2f}x "
            f"| {m / med['cp -r && sync']:.2f}x | {torch_t / m:.2f}x |"
        )
    # CPU seconds (user + system) are paired too: on a loaded machine they move far less than wall time.
    for times, what in ((walls, ""), (cpus, " in CPU seconds")):
        print()
        for name in times:
            if name.startswith("stagerd consolidate --dtype "):
                per_byte = written[name] / written["stagerd consolidate"]
                cast = name.removeprefix("stagerd consolidate --dtype ")
                print_pairs(cast, times[name], times["stagerd consolidate"], per_byte, what)
    if "torch consolidate + cast pass" in med:
        ratio = med["torch consolidate + cast pass"] / med["stagerd consolidate --dtype bf16"]
        print(f"\nfp32->bf16: stagerd is {ratio:.2f}x faster than torch consolidation + a cast pass")
    results = {
        name: {"walls": walls[name], "cpus": cpus[name], "median": med[name], "peak_rss_mib": rss[name]}
        for name in runs
    }
    if args.json:
        args.json.write_text(json.dumps({"size": size, "results": results}, indent=1))
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    if len(sys.argv) == 8 and sys.argv[1] == "--generate":
        sys.path.insert(0, str(ROOT))
        a = sys.argv
        _generate_here(Path(a[2]), float(a[3]), int(a[4]), int(a[5]), bool(int(a[6])), int(a[7]))
    else:
        main()
