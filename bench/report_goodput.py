"""The markdown `bench_goodput.py` prints: one table of every method and interval, then the targets."""

from __future__ import annotations

import statistics


def _med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _cell(xs: list[float], fmt: str = "{:.3f}") -> str:
    if not xs:
        return "-"
    return f"{fmt.format(_med(xs))} ({fmt.format(min(xs))}-{fmt.format(max(xs))})"


def _one(x: float | None, fmt: str = "{:.3f}") -> str:
    return "-" if x is None else fmt.format(x)


LABELS = {
    "long": "saves every {long} steps, wait before the next optimizer step",
    "short": "saves every {short} steps (shorter than a write)",
    "unhidden": "saves every {long} steps, waiting right after the save",
}


def report(meta: dict, summary: dict) -> str:
    base = meta["base_step_s"]
    peak = meta["pinned_peak_gbs"]
    lines = [
        f"{meta['device']}, torch {meta['torch']}, Python {meta['python']}; "
        f"Llama {meta['params'] / 1e6:.0f}M params, {meta['bytes_per_save'] / 1e9:.2f} GB per save "
        f"(model + AdamW state); writer threads {meta['threads']}; load average "
        f"{' '.join(f'{x:.2f}' for x in meta['load_avg'])}",
        f"step time without saves: {base:.4f} s "
        f"(min-max {meta['base_spread'][0]:.4f}-{meta['base_spread'][1]:.4f});"
        f" disk floor (same bytes, one stream, fsynced): {meta['disk_floor_s']:.2f} s "
        f"({meta['bytes_per_save'] / meta['disk_floor_s'] / 1e9:.2f} GB/s; runs "
        f"{', '.join(f'{f:.2f}' for f in meta['disk_floors'])})"
        + (f"; pinned D2H peak {peak:.1f} GB/s" if peak else ""),
        "",
        "Medians over the saves after the first, (min-max); the first save apart. Stall: the loop blocked in "
        "save() and its waits. Lost: the save's K-step window against K steps without saves.",
        "",
        "| method | interval | stall per save (s) | loop time lost per save (s) "
        "| first save: stall / lost (s) | time to durable (s) | durable / disk floor | D2H GB/s (% peak) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for key, s in summary.items():
        name, label = key.split("|")
        d2h = "-"
        if label == "unhidden" and s["d2h_gbs"]:
            rate = _med(s["d2h_gbs"])
            d2h = f"{rate:.1f}" + (f" ({rate / peak:.0%})" if peak else "")
        lines.append(
            f"| {name} | {LABELS[label].format(**meta)} | {_cell(s['stall'])} | {_cell(s['lost'])} | "
            f"{_one(s['first_stall'])} / {_one(s['first_lost'])} | {_cell(s['durable'], '{:.2f}')} | "
            f"{_cell(s['durable_x_floor'], '{:.2f}x')} | {d2h} |"
        )
    during = meta["step_while_exporting"]
    lines += [
        "",
        f"step time while the daemon exported: {_med(during):.4f} s over {len(during)} steps "
        f"(without saves {base:.4f} s); the daemon's sink holds {meta['daemon_published_last'] or 'nothing'}"
        + (
            "; torch's StateDictStager.close() made a no-op for torch's best mode (torch 2.11's bug)"
            if meta["torch_close_patched"]
            else ""
        ),
    ]
    lines += targets(meta, summary)
    return "\n".join(lines)


def targets(meta: dict, summary: dict) -> list[str]:
    """The issue's targets, each with its figure."""
    ours, best = "stagerd", "dcp.async_save PROCESS+pinned"
    out = [""]

    def get(name: str, label: str, field: str) -> list[float]:
        return summary.get(f"{name}|{label}", {}).get(field, [])

    base, peak = meta["base_step_s"], meta["pinned_peak_gbs"]
    hidden = _med(get(ours, "long", "lost"))
    out.append(
        f"- loop time lost per save, hidden, long interval: {hidden:.4f} s = {hidden / base:.1%} of a step "
        "(target <= 5%)"
    )
    for label in ("long", "short"):
        a, b = _med(get(ours, label, "lost")), _med(get(best, label, "lost"))
        out.append(
            f"- loop time lost per save, {label} interval: stagerd {a:.3f} s, torch's best {b:.3f} s "
            "(target: stagerd <= torch)"
        )
    a, b = _med(get(ours, "long", "durable_x_floor")), _med(get(ours, "long", "durable"))
    t = _med(get(best, "long", "durable"))
    out.append(
        f"- time to durable: stagerd {b:.2f} s = {a:.2f}x the disk floor (target <= 1.3x); "
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
