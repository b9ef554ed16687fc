"""`stagerd status ROOT [--json]`: steps, their state per sink, timings, sizes and last error.

Reads the journal read-only, so it works while the daemon runs; it never imports torch.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any


def add_parser(sub: argparse._SubParsersAction, name: str) -> None:
    p = sub.add_parser(
        name, help="show the daemon's journal: steps, states, timings, errors", description=__doc__
    )
    p.add_argument("root", type=Path, metavar="ROOT", help="staging root")
    p.add_argument("--json", action="store_true", help="one JSON document for machines")
    p.add_argument("--all", action="store_true", help="include retired steps")
    p.set_defaults(func=run)


def collect(root: Path, *, include_retired: bool) -> dict[str, Any]:
    """The status document: daemon, disk, and every step with its lanes."""
    from stagerd.daemon.journal import Journal
    from stagerd.daemon.lock import running_holder
    from stagerd.daemon.retention import disk_state

    journal = Journal.open_readonly(root)
    try:
        meta = journal.meta()
        steps = journal.steps(include_retired=include_retired)
        lanes = journal.lanes()
        counts = journal.counts()
    finally:
        journal.close()
    disk = disk_state(
        root,
        low_percent=float(meta.get("low_disk_free_percent", 10.0)),
        low_bytes=int(meta.get("low_disk_free_bytes", 0)),
    )
    by_step: dict[int, list[dict[str, Any]]] = {}
    for ln in lanes:
        by_step.setdefault(ln.step, []).append(asdict(ln))
    now = time.time()
    out_steps = []
    for s in steps:
        d = asdict(s)
        d["lanes"] = by_step.get(s.step, [])
        d["age_seconds"] = round(now - s.marker_mtime, 3)
        out_steps.append(d)
    return {
        "root": str(root),
        "daemon_pid": running_holder(root),
        "sinks": meta.get("sinks", []),
        "keep_last": meta.get("keep_last"),
        "disk": {
            "free": disk.free,
            "total": disk.total,
            "free_percent": round(disk.free_percent, 2),
            "low": disk.low,
        },
        "counts": counts,
        "steps": out_steps,
    }


def _size(n: int | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return str(n)


def _secs(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}s"


def _lane_cell(lane: dict[str, Any] | None) -> str:
    if lane is None:
        return "-"
    state = lane["state"]
    if state == "published":
        return f"[green]published[/] {_secs(lane['seconds'])}"
    if state in ("failed", "quarantined"):
        color = "yellow" if state == "failed" else "red"
        return f"[{color}]{state}[/] ({lane['attempts']}x)"
    return state


def render(doc: dict[str, Any]) -> None:
    """A rich table on stdout."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console()
    pid = doc["daemon_pid"]
    disk = doc["disk"]
    console.print(
        f"[bold]{escape(doc['root'])}[/]: daemon "
        + (f"running (pid {pid})" if pid else "[yellow]not running[/]")
        + f"; {_size(disk['free'])} free ({disk['free_percent']:.1f}%)"
        + (
            " [bold red]LOW DISK: unpublished steps are kept; publishing must catch up[/]"
            if disk["low"]
            else ""
        )
    )
    sinks = list(doc["sinks"])
    for s in doc["steps"]:
        for ln in s["lanes"]:
            if ln["sink"] not in sinks:
                sinks.append(ln["sink"])
    table = Table(show_lines=False)
    for col in ("step", "state", "age", "export", "size"):
        table.add_column(col, justify="right" if col in ("step", "age", "export", "size") else "left")
    for sink in sinks:
        table.add_column(escape(sink))
    table.add_column("last error", overflow="fold")
    for s in doc["steps"]:
        lanes = {ln["sink"]: ln for ln in s["lanes"]}
        errors = [f"{s['error_class']}: {s['error_message']}"] if s["error_class"] else []
        errors += [
            f"{k}: {ln['error_class']}: {ln['error_message']}" for k, ln in lanes.items() if ln["error_class"]
        ]
        state = s["state"]
        color = {"quarantined": "red", "failed": "yellow", "published": "green", "retired": "dim"}.get(state)
        table.add_row(
            str(s["step"]),
            f"[{color}]{state}[/]" if color else state,
            _secs(s["age_seconds"]),
            _secs(s["export_seconds"]),
            _size(s["export_bytes"]),
            *[_lane_cell(lanes.get(sink)) for sink in sinks],
            escape("; ".join(errors)) if errors else "",
        )
    console.print(table)
    counts = ", ".join(f"{n} {k}" for k, n in doc["counts"].items() if n)
    console.print(counts or "no steps yet")


def run(args: argparse.Namespace) -> int:
    doc = collect(args.root, include_retired=args.all)
    if args.json:
        json.dump(doc, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        render(doc)
    return 0
