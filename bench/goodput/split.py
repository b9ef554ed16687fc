"""stagerd's steps by what its daemon was doing: exporting or publishing against idle.

A stagerd run slower than the no-save baseline is either the daemon working beside the loop or the loop's
own speed drifting since the baseline. Within one run the steps while the daemon worked and those while it
was idle drifted alike, so their difference is the daemon's; the no-save steps right after the run (its
backlog published, the daemon running idle) add idle steps where the run itself has few.
"""

from __future__ import annotations

import statistics

LABELS = {"long": "every {long} steps", "short": "every {short} steps"}


def _overlaps(intervals: list, a: float, b: float) -> bool:
    return any(s < b and a < e for s, e in intervals)


def split(r: dict, daemon: list) -> dict:
    """Step times of one stagerd run (and its adjacent after-window) by the daemon's activity. The save's
    step and the next (which waits for the save's copy) are left out: they are the save's, not the daemon's.
    """
    k, n_saves = r["k"], len(r["saves"])
    writes = [(s["t0"], s["durable_at"] or float("inf")) for s in r["saves"]]
    out: dict[str, list[float]] = {"working": [], "working_nowrite": [], "idle": [], "quiet": [], "after": []}
    for i, (t, start) in enumerate(zip(r["times"], r["starts"], strict=True)):
        step = i + 1
        saved = step % k == 0 and step <= k * n_saves
        waits = (step - 1) % k == 0 and k <= step - 1 <= k * n_saves
        if saved or waits:
            continue
        # The daemon yields the disk to a save being written, its export paused yet counted as working:
        # the steps without the save's own write in flight compare the daemon's work alone.
        nowrite = not _overlaps(writes, start, start + t)
        if _overlaps(daemon, start, start + t):
            out["working"].append(t)
            if nowrite:
                out["working_nowrite"].append(t)
        else:
            out["idle"].append(t)
            if nowrite:
                out["quiet"].append(t)
    after = (r.get("adjacent") or {}).get("after") or {"times": [], "starts": []}
    for t, start in zip(after["times"], after["starts"], strict=True):
        if not _overlaps(daemon, start, start + t):
            out["after"].append(t)
    return out


def _med(xs: list[float]) -> str:
    return f"{statistics.median(xs):.4f} ({len(xs)})" if xs else "- (0)"


def _diff(a: list[float], b: list[float]) -> str:
    return f"{(statistics.median(a) - statistics.median(b)) * 1e3:+.1f}" if a and b else "-"


def table(raw: dict) -> list[str]:
    """The split of each stagerd run the daemon watched; nothing for a run without the daemon."""
    runs = [(label, raw["runs"][f"stagerd|{label}"]) for label in LABELS if f"stagerd|{label}" in raw["runs"]]
    if not runs or not raw["published"]:
        return []
    daemon = raw["export_intervals"] + raw.get("publish_intervals", [])
    what = "exported or published" if "publish_intervals" in raw else "exported (publishing not recorded)"
    lines = [
        "",
        "The daemon's effect apart from drift: stagerd's step times (s, median (steps)) while the daemon "
        f"{what} against while it was idle (polled every 50 ms; a paused export counts as working); the "
        "save's step and the next left out. No write: no save of the run being written during the step. "
        "After: the no-save steps right after the run, the daemon's backlog published, the daemon idle.",
        "",
        "| stagerd, saves | daemon working | working, no write | daemon idle, in the run | idle, no write | "
        "daemon idle, after the run | working - idle (ms) | the same, no write (ms) | working, no write - "
        "after (ms) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for label, r in runs:
        s = split(r, daemon)
        w, w0, i, i0, a = (s[key] for key in ("working", "working_nowrite", "idle", "quiet", "after"))
        lines.append(
            f"| {LABELS[label].format(**raw['meta'])} | {_med(w)} | {_med(w0)} | {_med(i)} | {_med(i0)} | "
            f"{_med(a)} | {_diff(w, i)} | {_diff(w0, i0)} | {_diff(w0, a)} |"
        )
    return lines
