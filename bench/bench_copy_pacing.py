"""How long the loop's own small device-to-host copy (`loss.item()`) waits behind a save's host copy.

    python bench/bench_copy_pacing.py               # CUDA only: 1.9 GB in 131 MB and 12 MB tensors

Per trial: ~60 ms of matrix products queued on the compute stream, then the save's host copy started on
the Stager's side stream (it waits for the products), then one more product and `.item()` on the compute
stream, as a loop that logs its loss does right after `optimizer.step()` and `save()`. Reported: how much
longer `.item()` took than without a copy, and the copy's own rate, for the copy queued whole
(`COPY_WINDOW` unbounded) and paced (`host_copy`'s window), with the main thread either waiting in
`.item()` (the GIL free) or busy launching small kernels (the GIL contended).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    import torch

    import stagerd.training.host_copy as hc
    from stagerd.training.host_pool import HostPool

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=7)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure")
        return
    dev = torch.device("cuda")
    sizes = [131 << 20] * 2 + [12 << 20] * 140  # a ~1B Llama's embeddings and layer weights, in bytes
    tensors = {f"t{i}": torch.ones(n // 2, dtype=torch.bfloat16, device=dev) for i, n in enumerate(sizes)}
    nbytes = sum(sizes)
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    pool = HostPool(pin=True, name="bench")
    copier = hc.HostCopier(pool, ThreadPoolExecutor(1))
    copier.start(tensors).result()  # buffers allocated and page-locked, off the clock
    window = hc.COPY_WINDOW

    def busy_launching() -> None:  # the next step's Python launching kernels: the GIL contended
        y = torch.zeros(1, device=dev)
        for _ in range(2000):
            y += 1

    def item_wait(copy: bool, busy: bool) -> float:
        torch.cuda.synchronize()
        for _ in range(60):
            a @ a  # ~1.4 ms each on an H100/H200
        st = copier.start(tensors) if copy else None
        t0 = time.perf_counter()
        x = (a @ a).sum()
        if busy:
            busy_launching()
        x.item()
        waited = time.perf_counter() - t0
        if st is not None:
            st.result()
        return waited

    def copy_rate(busy: bool) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        st = copier.start(tensors)
        if busy:
            busy_launching()
        st.result()
        return nbytes / (time.perf_counter() - t0) / 1e9

    def cell(xs: list[float], fmt: str) -> str:
        return f"{fmt.format(statistics.median(xs))} ({fmt.format(min(xs))}-{fmt.format(max(xs))})"

    gb = nbytes / 1e9
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}; {gb:.2f} GB in {len(sizes)} tensors")
    print("| copy | main thread | .item() extra wait, ms (min-max) | copy GB/s (min-max) |")
    print("|---|---|---|---|")
    for busy in (False, True):
        base = statistics.median([item_wait(False, busy) for _ in range(args.trials)])
        paced = f"paced ({window} x {hc.COPY_CHUNK_BYTES >> 20} MB)"
        for label, w in (("queued whole", 1 << 30), (paced, window)):
            hc.COPY_WINDOW = w
            item_wait(True, busy)
            extra = [(item_wait(True, busy) - base) * 1e3 for _ in range(args.trials)]
            rate = [copy_rate(busy) for _ in range(args.trials)]
            where = "launching kernels" if busy else "waiting"
            print(f"| {label} | {where} | {cell(extra, '{:.2f}')} | {cell(rate, '{:.1f}')} |", flush=True)
        hc.COPY_WINDOW = window
    pool.close()


if __name__ == "__main__":
    main()
