"""How long the loop's own small device-to-host copy (`loss.item()`) waits behind a save's host copy.

    python bench/bench_copy_pacing.py [--json out.json]    # CUDA only: 2 GB in 131 MB and 12 MB tensors

Per trial: ~80 ms of matrix products queued on the compute stream, then the save's host copy started on
the Stager's side stream (it waits for the products), then one more product and `.item()` on the compute
stream, as a loop that logs its loss does right after `optimizer.step()` and `save()`. Reported per way of
issuing the copy (`VARIANTS`: `host_copy`'s piece size, pieces ahead, how its thread waits): how much
longer `.item()` took than without a copy, and the copy's own rate, with the main thread waiting in
`.item()` (the GIL free) or busy launching small kernels (the GIL contended). `--json` keeps the figures
for `bench_goodput.py --copy-variant best:FILE`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _polled(ev: Any) -> None:
    while not ev.query():
        time.sleep(0.0002)


def _blocking(stream: Any) -> Any:
    import torch

    ev = torch.cuda.Event(blocking=True)
    ev.record(stream)
    return ev


# host_copy's module attributes each way sets; the rest keep the module's own values. Only the library's
# own way hurries (`Pace.hurry`: all the rest at once) when the caller waits for the copy.
WHOLE = 1 << 40
LIBRARY = "1 x 32 MB in flight, the rest at once when waited"
VARIANTS: dict[str, dict[str, Any]] = {
    LIBRARY: {},
    "whole": {"COPY_WINDOW": WHOLE, "COPY_LEAD": WHOLE},
    "paced 4 x 32 MB": {"COPY_WINDOW": 4, "COPY_LEAD": 4, "COPY_CHUNK_BYTES": 32 << 20},
    "gapped 1 x 32 MB": {"COPY_WINDOW": 1, "COPY_LEAD": 1, "COPY_CHUNK_BYTES": 32 << 20},
    "gapped 1 x 8 MB": {"COPY_WINDOW": 1, "COPY_LEAD": 1, "COPY_CHUNK_BYTES": 8 << 20},
    "whole, polled": {"COPY_WINDOW": WHOLE, "COPY_LEAD": WHOLE, "_wait": _polled},
    "whole, blocking-sync events": {"COPY_WINDOW": WHOLE, "COPY_LEAD": WHOLE, "_recorded": _blocking},
    "gapped 1 x 32 MB, polled": {
        "COPY_WINDOW": 1,
        "COPY_LEAD": 1,
        "COPY_CHUNK_BYTES": 32 << 20,
        "_wait": _polled,
    },
}


def apply(name: str) -> dict[str, Any]:
    """Set host_copy's attributes to variant `name`; the previous values, for `restore`."""
    import stagerd.training.host_copy as hc

    old = {k: getattr(hc, k) for k in VARIANTS[name]}
    for k, v in VARIANTS[name].items():
        setattr(hc, k, v)
    return old


def restore(old: dict[str, Any]) -> None:
    import stagerd.training.host_copy as hc

    for k, v in old.items():
        setattr(hc, k, v)


def best(results: list[dict[str, Any]]) -> str:
    """The variant whose `.item()` waits least while the main thread waits, among those copying at 95% or
    more of the whole copy's rate."""
    rows = [r for r in results if not r["busy"]]
    whole = next(r["rate_gbs"] for r in rows if r["variant"] == "whole")
    fast = [r for r in rows if r["rate_gbs"] >= 0.95 * whole]
    return min(fast, key=lambda r: r["extra_ms"])["variant"]


def main() -> None:
    import torch

    import stagerd.training.host_copy as hc
    from stagerd.training.host_pool import HostPool

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=7)
    p.add_argument("--json", default=None)
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
    copier = hc.HostCopier({"bench": pool}, ThreadPoolExecutor(1))
    hurries = [False]

    def start() -> Any:
        """The save's copy as `Stager.save()` leaves it when it returns: steady."""
        copy = copier.start({"bench": (tensors, ())})
        copy.pace.steady()
        return copy

    def landed(copy: Any) -> None:
        """Wait for the copy as `wait_staged()` does."""
        if hurries[0]:
            copy.pace.hurry()
        copy.staging["bench"].result()

    landed(start())  # buffers allocated and page-locked, off the clock

    def busy_launching() -> None:  # the next step's Python launching kernels: the GIL contended
        y = torch.zeros(1, device=dev)
        for _ in range(2000):
            y += 1

    def item_wait(copy: bool, busy: bool) -> float:
        torch.cuda.synchronize()
        for _ in range(60):
            a @ a  # ~1.4 ms each on an H100/H200
        st = start() if copy else None
        t0 = time.perf_counter()
        x = (a @ a).sum()
        if busy:
            busy_launching()
        x.item()
        waited = time.perf_counter() - t0
        if st is not None:
            landed(st)
        return waited

    def copy_rate(busy: bool) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        st = start()
        if busy:
            busy_launching()
        landed(st)
        return nbytes / (time.perf_counter() - t0) / 1e9

    def cell(xs: list[float], fmt: str) -> str:
        return f"{fmt.format(statistics.median(xs))} ({fmt.format(min(xs))}-{fmt.format(max(xs))})"

    gb = nbytes / 1e9
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}; {gb:.2f} GB in {len(sizes)} tensors")
    print("| copy issued | main thread | .item() extra wait, ms (min-max) | copy GB/s (min-max) |")
    print("|---|---|---|---|")
    results = []
    for busy in (False, True):
        base = statistics.median([item_wait(False, busy) for _ in range(args.trials)])
        for name in VARIANTS:
            old = apply(name)
            hurries[0] = name == LIBRARY
            try:
                item_wait(True, busy)
                extra = [(item_wait(True, busy) - base) * 1e3 for _ in range(args.trials)]
                rate = [copy_rate(busy) for _ in range(args.trials)]
            finally:
                restore(old)
            where = "launching kernels" if busy else "waiting"
            print(f"| {name} | {where} | {cell(extra, '{:.2f}')} | {cell(rate, '{:.1f}')} |", flush=True)
            results.append(
                {
                    "variant": name,
                    "busy": busy,
                    "extra_ms": statistics.median(extra),
                    "extra_ms_all": extra,
                    "rate_gbs": statistics.median(rate),
                    "rate_gbs_all": rate,
                }
            )
    pool.close()
    chosen = best(results)
    print(f"least .item() wait at >= 95% of the whole copy's rate: {chosen}")
    if args.json:
        Path(args.json).write_text(json.dumps({"results": results, "best": chosen}, indent=1))


if __name__ == "__main__":
    main()
