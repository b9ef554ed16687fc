"""The demo's closing summary: what ran, how long it took, how big it was, where the output is."""

from __future__ import annotations

from stagerd.demo.plan import WORLD, DemoResult
from stagerd.sinks.objects import redact_url


def _size(n: int | None) -> str:
    from rich.filesize import decimal

    return "-" if n is None else decimal(n)


def _secs(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}s"


def format_summary(result: DemoResult, total_seconds: float) -> str:
    """One table row per step, then the phase timings and the next command to try."""
    plan = result.plan
    by_step = {row.get("step"): row for row in result.status}
    lines = [
        f"stagerd demo: {plan.steps} steps trained, staged, exported, published and checked "
        f"in {total_seconds:.1f}s",
        f"  demo directory  {plan.workdir}",
        f"  staging ROOT    {plan.staging}",
        *(f"  sink            {redact_url(s)}" for s in plan.sinks),
        "",
        f"  {'step':>4}  {'staged':>9}  {'exported':>9}  {'save stall':>10}  {'export':>7}  {'publish':>7}  "
        f"{'state':<10}  checked copy",
    ]
    for i, step in enumerate(sorted(result.staged_bytes)):
        row = by_step.get(step, {})
        lanes = row.get("lanes") or []
        publish = max((lane.get("seconds") or 0.0 for lane in lanes), default=None)
        stall = result.save_stall_seconds[i] if i < len(result.save_stall_seconds) else None
        lines.append(
            f"  {step:>4}  {_size(result.staged_bytes[step]):>9}  {_size(row.get('export_bytes')):>9}  "
            f"{_secs(stall):>10}  {_secs(row.get('export_seconds')):>7}  {_secs(publish):>7}  "
            f"{row.get('state', '?'):<10}  {result.checked.get(step, '-')}"
        )
    lines += [
        "",
        f"  training + staging ({WORLD} gloo ranks, FSDP2, CPU): {result.train_seconds:.1f}s; "
        f"`stagerd watch --once`: {result.watch_seconds:.1f}s",
        f"  every step loads with safetensors and equals the trained weights bit for bit "
        f"({result.tensors} tensors per step)",
        f"  next: stagerd status {plan.staging}",
    ]
    return "\n".join(lines)
