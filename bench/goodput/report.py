"""The markdown `bench_goodput.py` prints: one table of every method and interval, then the targets."""

from __future__ import annotations

import statistics

from .split import table


def _med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _mean(xs: list[float]) -> float:
    """The mean step, steps over 1.5x the median left out (the first step's compile, a page-in): K steps
    take K times the mean, not the median, and no-save steps are skewed (a slow step every few)."""
    kept = [x for x in xs if x <= 1.5 * _med(xs)]
    return statistics.fmean(kept) if kept else float("nan")


def _cell(xs: list[float], fmt: str = "{:.3f}") -> str:
    if not xs:
        return "-"
    return f"{fmt.format(_med(xs))} ({fmt.format(min(xs))}-{fmt.format(max(xs))})"


def _one(x: float | None, fmt: str = "{:.3f}") -> str:
    return "-" if x is None else fmt.format(x)


LABELS = {
    "long": "saves every {long} steps, wait before the next optimizer step",
    "short": "saves every {short} steps (shorter than a write)",
    "unhidden": "saves every {long} steps, waiting right after the save (no daemon)",
}


def summarize(r: dict, base: float, nbytes: int, floor: float, base_mean: float = float("nan")) -> dict:
    """Per save: blocked seconds, loop time lost over its K-step window, time to durable; first apart."""
    k, times, saves = r["k"], r["times"], r["saves"]
    windows = [sum(times[k * j - 1 : k * (j + 1) - 1]) for j in range(1, len(saves) + 1)]
    lost = [w - k * base for w in windows]
    steady = _med(times)  # the run's own step: robust to a loop whose speed drifted from the baseline's
    lost_self = [w - k * steady for w in windows]
    # The no-save steps right before and after the run: drift-free like its own step, without counting
    # what the saves (and the daemon they feed) do to the steps between them. Absent from older JSON.
    adj = r.get("adjacent") or {}
    before, after = ((adj.get(side) or {}).get("times", []) for side in ("before", "after"))
    adjacent = _med(before + after)
    lost_adj = [w - k * adjacent for w in windows] if before or after else []
    # By the mean, and how far apart the two adjacent windows are: the loss is resolved no finer than that.
    lost_mean = [w - k * base_mean for w in windows]
    lost_adj_mean = [w - k * _mean(before + after) for w in windows] if before or after else []
    spread = k * abs(_mean(before) - _mean(after)) if before and after else float("nan")
    blocked = [s["blocked"] for s in saves]
    durable = [s["durable_at"] - s["t0"] for s in saves if s["durable_at"] is not None]
    return {
        "stall": blocked[1:],
        "first_stall": blocked[0] if blocked else None,
        "lost": lost[1:],
        "first_lost": lost[0] if lost else None,
        "lost_self": lost_self[1:],
        "first_lost_self": lost_self[0] if lost_self else None,
        "steady_step": steady,
        "lost_adj": lost_adj[1:],
        "lost_mean": lost_mean[1:],
        "lost_adj_mean": lost_adj_mean[1:],
        "adjacent_spread": spread,
        "first_lost_adj": lost_adj[0] if lost_adj else None,
        "adjacent_before": _med(before),
        "adjacent_after": _med(after),
        "adjacent_steps": len(before) + len(after),
        "durable": durable[1:],
        "durable_x_floor": [d / floor for d in durable[1:]],
        "d2h_gbs": [nbytes / b / 1e9 for b in blocked[1:] if b > 0],
    }


def _adjacent(s: dict) -> str:
    if not s["adjacent_steps"]:
        return "-"
    return f"{_cell(s['lost_adj'])} (steps {s['adjacent_before']:.4f} / {s['adjacent_after']:.4f})"


def _busy(intervals: list, a: float, b: float) -> bool:
    return any(s < b and a < e for s, e in intervals)


def report(raw: dict) -> str:
    """The markdown report of one run's raw figures (what `--json` keeps)."""
    meta = dict(raw["meta"])
    base_times = [t for times in raw["base"] for t in times]
    base = _med(base_times)
    nbytes = meta["bytes_per_save"]
    floor = _med(meta["disk_floors"])
    peak = meta["pinned_peak_gbs"]
    summary = {key: summarize(r, base, nbytes, floor, _mean(base_times)) for key, r in raw["runs"].items()}
    mine = raw["runs"].get("stagerd|long", {"times": [], "starts": []})
    during = [
        t
        for t, s in zip(mine["times"], mine["starts"], strict=True)
        if _busy(raw["export_intervals"], s, s + t)
    ]
    load = " ".join(f"{x:.2f}" for x in meta.get("load_avg", []))
    lines = [
        f"{meta['device']}, torch {meta['torch']}, Python {meta['python']}; "
        f"Llama {meta['params'] / 1e6:.0f}M params, {nbytes / 1e9:.2f} GB per save "
        f"(model + AdamW state); writer threads {meta['threads']}; load average {load}"
        + (f"; stagerd's host copy issued as: {meta['copy_variant']}" if meta.get("copy_variant") else ""),
        f"step time without saves: {base:.4f} s (min-max {min(base_times):.4f}-{max(base_times):.4f}); "
        f"disk floor (same bytes, one stream, fsynced): {floor:.2f} s ({nbytes / floor / 1e9:.2f} GB/s; runs "
        f"{', '.join(f'{f:.2f}' for f in meta['disk_floors'])})"
        + (f"; pinned D2H peak {peak:.1f} GB/s" if peak else ""),
        "",
        "Medians over the saves after the first, (min-max); the first save apart. Stall: the loop blocked in "
        "save() and its waits. Lost: the save's K-step window against K steps without saves: the baseline "
        "(before and after all runs), the run's own median step, and the median of the no-save steps right "
        "before and right after the run (their medians: before / after).",
        "",
        "| method | interval | stall per save (s) | lost per save vs no saves (s) | lost per save vs the "
        "run's own step (s) | lost per save vs adjacent no-save steps (s) | first save: stall / lost vs own "
        "step (s) | time to durable (s) | durable / disk floor | D2H GB/s (% peak) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key, s in summary.items():
        name, label = key.split("|")
        d2h = "-"
        if label == "unhidden" and s["d2h_gbs"]:
            rate = _med(s["d2h_gbs"])
            d2h = f"{rate:.1f}" + (f" ({rate / peak:.0%})" if peak else "")
        lines.append(
            f"| {name} | {LABELS[label].format(**meta)} | {_cell(s['stall'])} | {_cell(s['lost'])} | "
            f"{_cell(s['lost_self'])} (step {s['steady_step']:.3f}) | {_adjacent(s)} | "
            f"{_one(s['first_stall'])} / {_one(s['first_lost_self'])} | {_cell(s['durable'], '{:.2f}')} | "
            f"{_cell(s['durable_x_floor'], '{:.2f}x')} | {d2h} |"
        )
    lines += [
        "",
        f"step time while the daemon exported: {_med(during):.4f} s over {len(during)} steps "
        f"(without saves {base:.4f} s); the daemon's sink holds {raw['published'] or 'nothing'}",
    ]
    lines += table(raw)
    if meta["torch_close_patched"]:
        lines.append(
            "torch's StateDictStager.close() was made a no-op for torch's best mode (torch 2.11's bug)"
        )
    lines += [f"error: {e}" for e in raw.get("errors", [])]
    lines += targets(base, peak, summary)
    return "\n".join(lines)


def targets(base: float, peak: float | None, summary: dict) -> list[str]:
    """The issue's targets, each with its figure."""
    ours, best = "stagerd", "dcp.async_save PROCESS+pinned"
    out = [""]

    def get(name: str, label: str, field: str) -> list[float]:
        return summary.get(f"{name}|{label}", {}).get(field, [])

    hidden = _med(get(ours, "long", "lost"))
    out.append(
        f"- loop time lost per save, hidden, long interval: {hidden:.4f} s = {hidden / base:.1%} of a step "
        "(target <= 5%)"
    )
    adjacent = _med(get(ours, "long", "lost_adj"))
    if get(ours, "long", "lost_adj"):
        out.append(
            f"- the same against the no-save steps right before and after the run: {adjacent:.4f} s = "
            f"{adjacent / base:.1%} of a step"
        )
    by_mean, adj_mean = _med(get(ours, "long", "lost_mean")), _med(get(ours, "long", "lost_adj_mean"))
    spread = summary.get(f"{ours}|long", {}).get("adjacent_spread", float("nan"))
    out.append(
        f"- the same by the mean no-save step: {by_mean:.4f} s = {by_mean / base:.1%} of a step against the "
        f"baseline, {adj_mean:.4f} s = {adj_mean / base:.1%} against the adjacent steps; the windows before "
        f"and after the run differ by {spread:.4f} s over the same K steps (the resolution)"
    )
    for label in ("long", "short"):
        a, b = _med(get(ours, label, "lost_self")), _med(get(best, label, "lost_self"))
        out.append(
            f"- loop time lost per save (against the run's own step), {label} interval: stagerd {a:.3f} s, "
            f"torch's best {b:.3f} s (target: stagerd <= torch)"
        )
    for label, what in (("unhidden", "alone"), ("long", "with the daemon exporting beside it")):
        a, b = _med(get(ours, label, "durable_x_floor")), _med(get(ours, label, "durable"))
        t = _med(get(best, label, "durable"))
        out.append(
            f"- time to durable, {what}: stagerd {b:.2f} s = {a:.2f}x the disk floor (target <= 1.3x); "
            f"torch's best {t:.2f} s"
        )
    if peak:
        rate = _med(get(ours, "unhidden", "d2h_gbs"))
        out.append(
            f"- unhidden stall: {rate:.1f} GB/s = {rate / peak:.0%} of the pinned D2H peak (target >= 85%)"
        )
    first, steady = summary.get(f"{ours}|long", {}).get("first_stall"), _med(get(ours, "long", "stall"))
    if first is not None:
        out.append(f"- first save's stall {first:.3f} s against a steady {steady:.3f} s (target <= 2x)")
    return out
