"""What copying the buffers at `save()` adds to the stall: `Stager.save()`'s return time, before and now.

    python bench/bench_eager_buffers.py --saves 15

One process, CPU (CUDA when present). Two models: a Llama (transformers, from a config: no persistent
buffers) and a ResNet-18-shaped CNN with BatchNorm, each saved three ways: with `model=`, with an
attached optimizer, and with neither (then the tensors of at most `EAGER_MAX_BYTES` are copied at save()).
"before" is the previous behaviour (nothing copied at save(); `Owners.eager` made to return nothing), "now"
the current one; the two alternate save by save on the same Stager, so each pair sees the same machine.
Only `save()` is timed (what the loop stands still for); each save is committed before the next.
Prints a markdown table: median and min-max of save() in ms, the median of paired differences, and the
bytes copied at save().
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _llama(device):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=8,
        vocab_size=8000,
    )
    return LlamaForCausalLM(cfg).to(device, torch.bfloat16)


def _resnet18(device):
    import torch
    from torch import nn

    def block(cin: int, cout: int, stride: int) -> nn.Module:
        return nn.Sequential(
            nn.Conv2d(cin, cout, 3, stride, 1, bias=False),
            nn.BatchNorm2d(cout),
            nn.ReLU(),
            nn.Conv2d(cout, cout, 3, 1, 1, bias=False),
            nn.BatchNorm2d(cout),
        )

    layers: list[nn.Module] = [nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU()]
    cin = 64
    for cout in (64, 128, 256, 512):
        layers += [block(cin, cout, 1 if cout == 64 else 2), block(cout, cout, 1)]
        cin = cout
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, 1000)]
    torch.manual_seed(0)
    return nn.Sequential(*layers).to(device)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--saves", type=int, default=15, help="saves per arm and case")
    args = ap.parse_args()
    import torch

    from stagerd import Stager
    from stagerd.training import eager

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    real_eager = eager.Owners.eager
    rows = []
    root = Path(tempfile.mkdtemp(prefix="bench-eager-"))
    try:
        for mname, make in (("Llama (no buffers)", _llama), ("ResNet-18 (BatchNorm)", _resnet18)):
            model = make(device)
            mib = sum(t.numel() * t.element_size() for t in model.state_dict().values()) / 2**20
            for how in ("model=", "attach", "neither"):
                optim = torch.optim.SGD(model.parameters(), lr=0.0)
                times: dict[str, list[float]] = {"before": [], "now": []}
                sd = model.state_dict()
                owners = eager.Owners.of(
                    model if how == "model=" else None, [optim] if how == "attach" else []
                )
                eager_bytes = sum(sd[n].untyped_storage().nbytes() for n in real_eager(owners, sd))
                t0 = time.perf_counter()
                for _ in range(20):
                    owners = eager.Owners.of(
                        model if how == "model=" else None, [optim] if how == "attach" else []
                    )
                    real_eager(owners, sd)
                which_ms = (time.perf_counter() - t0) / 20 * 1e3
                with Stager(root / f"{mname[:5]}-{how}", pin_memory=False) as stager:
                    if how == "attach":
                        stager.attach(optim)
                    step = 0
                    for i in range(args.saves + 1):
                        for arm in ("before", "now") if i % 2 else ("now", "before"):
                            step += 1
                            eager.Owners.eager = real_eager if arm == "now" else (lambda self, t: set())  # type: ignore[method-assign]
                            if device.type == "cuda":
                                torch.cuda.synchronize()
                            t0 = time.perf_counter()
                            stager.save(model.state_dict(), step, model=model if how == "model=" else None)
                            dt = time.perf_counter() - t0
                            stager.wait()
                            shutil.rmtree(stager.step_dir(step))
                            if i:  # the first pair allocates the host buffers
                                times[arm].append(dt * 1e3)
                eager.Owners.eager = real_eager  # type: ignore[method-assign]
                diffs = [n - b for n, b in zip(times["now"], times["before"], strict=True)]
                rows.append((mname, mib, how, eager_bytes, which_ms, times["before"], times["now"], diffs))
    finally:
        shutil.rmtree(root, ignore_errors=True)

    def span(v: list[float]) -> str:
        return f"{statistics.median(v):.2f} ({min(v):.2f}-{max(v):.2f})"

    load = os.getloadavg()[0]
    print(
        f"device {device}, torch {torch.__version__}, load average {load:.2f}, {args.saves} saves per arm\n"
    )
    print(
        "| model | state | parameters known from | copied at save() | choosing them, ms | save() before, ms "
        "| save() now, ms | now - before, paired median |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for mname, mib, how, eb, which_ms, before, now, diffs in rows:
        print(
            f"| {mname} | {mib:.0f} MiB | {how} | {eb / 1024:.1f} KiB | {which_ms:.2f} | {span(before)} | "
            f"{span(now)} | {statistics.median(diffs):+.2f} ms |"
        )


if __name__ == "__main__":
    main()
