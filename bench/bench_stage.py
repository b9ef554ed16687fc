"""Training-loop stall per save: `Stager.save()` + `wait_staged()` against the floor and torch's own paths.

    python bench/bench_stage.py --size-gb 2 --ranks 2 --saves 12

Every rank holds its `Shard(0)` part of a SIZE fp32 state dict (DTensors, 64 MiB global tensors) and saves
it SAVES times with each method; the stall of one save is the slowest rank's. Methods:

- floor: a bare copy of the same tensors into host buffers allocated and touched beforehand (pinned,
  `non_blocking` plus a synchronize with CUDA);
- stagerd: `Stager.save()` + `wait_staged()`; the write, fsync and commit run behind it (`commit` column);
- dcp.save: synchronous `torch.distributed.checkpoint.save` with the same HF writer (the whole save blocks);
- dcp.async_save: torch's defaults (the writer stages: a fresh host copy every save), until it returns.

Floor and stagerd alternate: a floor copy runs before the first save and after every save, so each save
sits between two floor copies and is compared with their mean (this machine drifts between memory-speed
regimes; a pair sees the same one). The headline is the median of these paired ratios over saves
2..SAVES; the ratio of the plain medians is printed beside it. Between saves each method waits until its
previous save is durable, so saves never overlap.
With CUDA (tensors on `cuda:LOCAL_RANK`, `cpu:gloo,cuda:nccl`) it also measures the pinned D2H peak of one
large copy and reports stagerd's achieved D2H rate against it.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CHUNK_ROWS = 4096
COLS = 4096  # 4096 x 4096 fp32 = 64 MiB per global tensor


def _sync(cuda: bool) -> None:
    if cuda:
        import torch

        torch.cuda.synchronize()


def _state_dict(size: int, world: int, rank: int, device):
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh(device.type, (world,))
    n = max(1, size // (CHUNK_ROWS * COLS * 4))
    sd = {}
    for i in range(n):
        rows = CHUNK_ROWS // world
        local = torch.full((rows, COLS), float(i + rank), device=device)
        sd[f"model.layers.{i}.weight"] = DTensor.from_local(
            local, mesh, [Shard(0)], run_check=False, shape=(CHUNK_ROWS, COLS), stride=(COLS, 1)
        )
    return sd


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


class _Floor:
    """A bare copy of the same tensors into host buffers allocated and touched beforehand."""

    def __init__(self, sd, cuda: bool) -> None:
        import torch

        self.sd, self.cuda = sd, cuda
        self.bufs = {k: torch.empty(_local(v).shape, dtype=v.dtype, pin_memory=cuda) for k, v in sd.items()}
        for b in self.bufs.values():
            b.zero_()  # touch the pages: the floor copies into memory that is already there

    def copy(self, barrier) -> float:
        """One tensor-by-tensor copy, timed like a save: one sample, as each stagerd save is one sample
        (timing two ways and keeping the faster would bias the floor low on a noisy machine)."""
        barrier()
        t0 = time.perf_counter()
        for k, v in self.sd.items():
            self.bufs[k].copy_(_local(v), non_blocking=self.cuda)
        _sync(self.cuda)
        return time.perf_counter() - t0


def _remove(path: Path) -> None:
    """Delete a finished save and let the file system settle, so that freeing its blocks (ext4 does part of
    it in the background) does not land inside the next measured copy."""
    shutil.rmtree(path)
    os.sync()
    time.sleep(0.3)


def _stagerd_and_floor(sd, saves: int, root: Path, rank: int, barrier, checkpointer, cuda: bool):
    """Interleaved, so that both see the same machine: floor copy, then a stagerd save, SAVES times."""
    from stagerd import Stager

    floor, stalls, commits = [], [], []
    copier = _Floor(sd, cuda)
    with Stager(root, checkpointer=checkpointer) as stager:
        stager.reserve(sd, wait=True)  # at set-up, as a script would: the first save allocates nothing
        for i in range(saves):
            if i == 0:
                floor.append(copier.copy(barrier))
            barrier()
            t0 = time.perf_counter()
            stager.save(sd, 100 + i)
            stager.wait_staged()
            t1 = time.perf_counter()
            stager.wait()
            stalls.append(t1 - t0)
            commits.append(time.perf_counter() - t0)
            floor.append(copier.copy(barrier))  # after save i, before save i + 1: every save sits between two
            barrier()
            if rank == 0:
                _remove(root / f"step-{100 + i:08d}")
    return floor, stalls, commits


def _dcp_sync(sd, saves: int, root: Path, rank: int, barrier):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    out = []
    for i in range(saves):
        d = root / f"sync-{i}"
        barrier()
        t0 = time.perf_counter()
        dcp.save(sd, storage_writer=HuggingFaceStorageWriter(str(d), save_distributed=True))
        out.append(time.perf_counter() - t0)
        barrier()
        if rank == 0:
            _remove(d)
    return out


def _dcp_async_default(sd, saves: int, root: Path, rank: int, barrier):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    out = []
    for i in range(saves):
        d = root / f"async-{i}"
        barrier()
        t0 = time.perf_counter()
        fut = dcp.async_save(sd, storage_writer=HuggingFaceStorageWriter(str(d), save_distributed=True))
        out.append(time.perf_counter() - t0)
        fut.result()
        barrier()
        if rank == 0:
            _remove(d)
    return out


def _rank(rank: int, world: int, init: str, args: argparse.Namespace, out: str) -> None:
    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available() and not args.cpu
    if cuda:
        torch.cuda.set_device(rank % torch.cuda.device_count())
    backend = "cpu:gloo,cuda:nccl" if cuda else "gloo"
    dist.init_process_group(backend, init_method=f"file://{init}", rank=rank, world_size=world)
    try:
        device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        sd = _state_dict(int(args.size_gb * 1e9), world, rank, device)
        local_bytes = sum(_local(v).numel() * _local(v).element_size() for v in sd.values())
        gloo = dist.new_group(backend="gloo")

        def barrier() -> None:
            _sync(cuda)
            dist.barrier(group=gloo)

        root = Path(args.root)
        res: dict = {"local_bytes": local_bytes, "cuda": cuda}
        from memory_probes import pinned_peak

        res["peak_gbs"] = pinned_peak(min(local_bytes, 2 << 30)) if cuda else None
        res["floor"], res["stagerd"], res["commit"] = _stagerd_and_floor(
            sd, args.saves, root, rank, barrier, args.checkpointer, cuda
        )
        if not args.skip_torch:
            res["dcp.async_save"] = _dcp_async_default(sd, args.saves, root, rank, barrier)
            res["dcp.save"] = _dcp_sync(sd, args.saves, root, rank, barrier)
        Path(out, f"rank{rank}.json").write_text(json.dumps(res))
    finally:
        dist.destroy_process_group()


def _worst(results: list[dict], method: str) -> list[float]:
    """Per save, the slowest rank's time."""
    return [max(r[method][i] for r in results) for i in range(len(results[0][method]))]


def _paired_floor(results: list[dict]) -> list[float]:
    """Per stagerd save, the mean of the floor copies just before and just after it."""
    f = _worst(results, "floor")
    return [(a + b) / 2 for a, b in itertools.pairwise(f)]


def _table(results: list[dict], saves: int) -> str:
    methods = [m for m in ("stagerd", "commit", "dcp.async_save", "dcp.save") if m in results[0]]
    rows = {"floor (mean of the copies either side)": _paired_floor(results)}
    rows.update(
        {
            ("stagerd: until committed (not a stall)" if m == "commit" else m): _worst(results, m)
            for m in methods
        }
    )
    floor_later = statistics.median(
        rows["floor (mean of the copies either side)"][1:] or rows["floor (mean of the copies either side)"]
    )
    head = "| method | " + " | ".join(f"save {i + 1} (s)" for i in range(saves)) + " | median 2.. / floor |"
    lines = [head, "|" + "---|" * (saves + 2)]
    for label, xs in rows.items():
        later = statistics.median(xs[1:] or xs)
        cells = " | ".join(f"{x:.3f}" for x in xs)
        lines.append(f"| {label} | {cells} | {later / floor_later:.2f}x |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-gb", type=float, default=2.0, help="total state dict size over all ranks")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--saves", type=int, default=12)
    p.add_argument("--root", default=None, help="staging directory (default: a temp dir, removed after)")
    p.add_argument("--checkpointer", default=None, choices=["thread", "process"], help="default: stagerd's")
    p.add_argument("--cpu", action="store_true", help="ignore CUDA even where it is available")
    p.add_argument("--skip-torch", action="store_true", help="only floor and stagerd")
    args = p.parse_args()

    import torch
    import torch.multiprocessing as mp

    own_root = args.root is None
    args.root = args.root or tempfile.mkdtemp(prefix="bench-stage-")
    out = tempfile.mkdtemp(prefix="bench-stage-out-")
    fd, init = tempfile.mkstemp(prefix="bench-stage-gloo-")
    os.close(fd)
    os.unlink(init)
    try:
        mp.start_processes(_rank, args=(args.ranks, init, args, out), nprocs=args.ranks, start_method="spawn")
        results = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(args.ranks)]
    finally:
        shutil.rmtree(out, ignore_errors=True)
        if own_root:
            shutil.rmtree(args.root, ignore_errors=True)
        if os.path.exists(init):
            os.unlink(init)

    cuda = results[0]["cuda"]
    per_rank = results[0]["local_bytes"]
    device = torch.cuda.get_device_name(0) if cuda else f"CPU only ({os.cpu_count()} cores)"
    print(
        f"\n{args.ranks} ranks x {per_rank / 1e9:.2f} GB = {args.ranks * per_rank / 1e9:.2f} GB fp32, "
        f"{device}, torch {torch.__version__}\n"
    )
    print(_table(results, args.saves))
    stall, floor = _worst(results, "stagerd"), _paired_floor(results)
    later, floor_later = stall[1:] or stall, floor[1:] or floor
    paired = statistics.median(s / f for s, f in zip(later, floor_later, strict=True))
    rate = per_rank / statistics.median(later) / 1e9
    print(
        f"\nstagerd stall from save 2 on: median {statistics.median(later):.3f} s; "
        f"paired with the floor copies either side: median {paired:.2f}x the floor (target <= 1.10x); "
        f"ratio of the plain medians {statistics.median(later) / statistics.median(floor_later):.2f}x; "
        f"{'D2H' if cuda else 'host copy'} {rate:.2f} GB/s per rank"
    )
    if cuda:
        peak = min(r["peak_gbs"] for r in results)
        print(
            f"pinned D2H peak (one {min(per_rank, 2 << 30) / 1e9:.1f} GB copy): {peak:.2f} GB/s per rank; "
            f"stagerd achieves {rate / peak:.0%} of it (target >= 80%)"
        )


if __name__ == "__main__":
    main()
