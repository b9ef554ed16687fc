"""The terminal view of `stagerd status`: one line per step at any width from 80 columns up.

Cells never wrap: an error is shortened to its class and first words in the table and printed in full
below it, sinks too long for a header are numbered with a legend, and the optional columns (age, export
time, size) are dropped, in that order, while the table would not fit. With more sinks than still fit, each
lane's time or tries goes on a second line under its state, and the error column, too narrow to say
anything, is left to the full errors below. A ROOT whose steps are all retired shows no table.
"""

from __future__ import annotations

import re
from typing import Any

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from stagerd.cmd.watch_hints import given_up_hint
from stagerd.daemon.journal.raw import RAW_LANE_PREFIX
from stagerd.daemon.policy import given_up as _given_up
from stagerd.daemon.policy import left_waiting
from stagerd.daemon.summary import missed_text
from stagerd.daemon.unfinished import Unfinished, unfinished_text

OPTIONAL = ("age", "export", "size")  # dropped from the left of this order first
_STATE_COLOR = {
    "quarantined": "red",
    "failed": "yellow",
    "waiting": "yellow",
    "published": "green",
    "retired": "dim",
    "lost": "yellow",
}
_LEADING_PLACE = re.compile(r"^(?:\S*[/\\]\S*|\[[^\]]*\]): ")  # "/path/to/file: " or "s3://b/k: "
_ERROR_WORDS = 8
_MIN_ERROR_WIDTH = 24


def size(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return str(n)


def secs(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}s"


def short_error(error_class: str, message: str | None) -> str:
    """`Class: first words…` without the leading path or URL the full message starts with."""
    text = message or ""
    while (m := _LEADING_PLACE.match(text)) is not None:
        text = text[m.end() :]
    words = text.split()
    more = "…" if len(words) > _ERROR_WORDS else ""
    return f"{error_class}: {' '.join(words[:_ERROR_WORDS])}{more}".rstrip(": ")


def _lane_cell(lane: dict[str, Any] | None, gap: str = " ") -> str:
    """A lane's state and its time or tries, `gap` between them (a newline in a narrow table)."""
    if lane is None:
        return "-"
    state = lane["state"]
    if state == "published":
        return f"[green]published[/]{gap}{secs(lane['seconds'])}"
    if state in ("failed", "waiting", "quarantined"):
        return f"[{_STATE_COLOR[state]}]{state}[/]{gap}{lane['attempts']}x"
    return str(state)


_Error = tuple[str, str, str | None, str | None]


def _errors(step: dict[str, Any], labels: dict[str, str], *, full: bool = False) -> list[_Error]:
    """(where, class, message, hint) of the step's own error and of each failing lane; `full`: the class of
    one left waiting for the next start says so, as the `--once` summary does."""
    out: list[_Error] = []
    for where, r in [("", step), *((labels[ln["sink"]], ln) for ln in step["lanes"])]:
        if r["error_class"]:
            cls = r["error_class"]
            if full and _left_waiting(r):
                cls = f"still waiting (not quarantined): {cls}"
            out.append((where, cls, r["error_message"], r.get("error_hint")))
    return out


def _left_waiting(row: dict[str, Any]) -> bool:
    """`policy.left_waiting` of a step or lane, one shown "waiting" (`status._shown_state`) being a failed
    one that waits."""
    state = "failed" if row["state"] == "waiting" else row["state"]
    return left_waiting(state, row.get("next_try"))


def _waits(step: dict[str, Any], labels: dict[str, str]) -> list[tuple[str, str]]:
    """(where, what) of each wait of the step: its export's, then each Hub lane's, each on its own."""
    out = [("", step["waiting"])] if step.get("waiting") else []
    return out + [(labels[ln["sink"]], ln["waiting"]) for ln in step["lanes"] if ln.get("waiting")]


def _plain(markup: str) -> str:
    return re.sub(r"\[/?[a-z ]*\]", "", markup)


def _sinks(doc: dict[str, Any]) -> list[str]:
    sinks = list(doc["sinks"])
    for s in doc["steps"]:
        for ln in s["lanes"]:
            if ln["sink"] not in sinks:
                sinks.append(ln["sink"])
    return sinks


def _rows(
    doc: dict[str, Any], sinks: list[str], labels: dict[str, str], gap: str = " "
) -> list[dict[str, str]]:
    rows = []
    for s in doc["steps"]:
        lanes = {ln["sink"]: ln for ln in s["lanes"]}
        errors = _errors(s, labels)
        state = s["state"]
        color = _STATE_COLOR.get(state)
        first = errors[0] if errors else None
        waits: list[_Error] = [(where, text, None, None) for where, text in _waits(s, labels)]
        if waits:  # what the step waits for says more than the error its last wait ended in
            first, errors = waits[0], [*waits, *errors]
        row = {
            "step": str(s["step"]),
            "state": (f"[{color}]{state}[/]" if color else state) + " (pinned)" * bool(s.get("pinned")),
            "age": secs(s["age_seconds"]),
            "export": secs(s["export_seconds"]),
            "size": size(s["export_bytes"]),
            "error": ""
            if first is None
            else escape(f"{first[0]} " * bool(first[0]) + short_error(first[1], first[2]))
            + (f" (+{len(errors) - 1})" if len(errors) > 1 else ""),
        }
        for sink in sinks:
            row[f"sink:{sink}"] = _lane_cell(lanes.get(sink), gap)
        rows.append(row)
    return rows


def _widths(columns: list[tuple[str, str]], rows: list[dict[str, str]]) -> list[int]:
    return [
        max([len(title), *(len(line) for r in rows for line in _plain(r[key]).splitlines())])
        for key, title in columns
    ]


def _room_for_error(columns: list[tuple[str, str]], rows: list[dict[str, str]], width: int) -> int:
    """Columns left for the error once every other column has its widest cell and its 3-column gap."""
    return width - sum(w + 3 for w in _widths(columns, rows))


def _clip(markup: str, room: int) -> str:
    """Escaped text cut to `room` characters with an ellipsis (the cells hold no markup but escapes)."""
    plain = markup.replace("\\[", "[")
    if len(plain) <= room:
        return markup
    return escape(plain[: max(room - 1, 0)] + "…")


def _daemon(doc: dict[str, Any]) -> str:
    pid, restore = doc["daemon_pid"], doc.get("holder") == "restore"
    where = f"pid {pid}" if pid else "in another container (pid namespace)"
    if not pid and not doc.get("held_elsewhere"):
        return "[yellow]not running[/]"
    return f"not running; a `stagerd restore` holds ROOT ({where})" if restore else f"running ({where})"


def render(doc: dict[str, Any], console: Console | None = None) -> None:
    """The status on `console` (stdout at the terminal's width, or $COLUMNS off a terminal)."""
    console = console or Console()
    width = console.width
    disk = doc["disk"]
    console.print(
        f"[bold]{escape(doc['root'])}[/]: daemon "
        + _daemon(doc)
        + f"; {size(disk['free'])} free ({disk['free_percent']:.1f}%)"
        + (
            " [bold red]LOW DISK: unpublished steps are kept; publishing must catch up[/]"
            if disk["low"]
            else ""
        ),
        overflow="fold",
    )
    if doc.get("note"):
        console.print(escape(doc["note"]), overflow="fold")
    for sink, m in doc.get("missed", {}).items():
        console.print(f"[yellow]{escape(missed_text(sink, m['count'], m['newest']))}[/]", overflow="fold")
    if (u := doc.get("unfinished")) and u["count"]:
        shown = [Unfinished(*x) for x in u["newest"]]
        text = unfinished_text(u["count"], shown, u["adopt"], then="the daemon")
        console.print(f"[yellow]at the daemon's last scan, {escape(text)}[/]", overflow="fold")
    sinks = _sinks(doc)
    base = [("step", "step"), ("state", "state")]
    optional = [(k, k) for k in OPTIONAL]
    if len(sinks) == 1:
        # one sink needs no label in an error; it is named in the header, or in a line above the table
        labels, rows = {sinks[0]: ""}, _rows(doc, sinks, {sinks[0]: ""})
        chosen = base + optional + [(f"sink:{sinks[0]}", sinks[0])]
        header = {sinks[0]: sinks[0]}
        if _room_for_error(chosen, rows, width) < _MIN_ERROR_WIDTH:
            header = {sinks[0]: "sink"}
    else:
        labels = {s: f"[{i}]" for i, s in enumerate(sinks, 1)}
        rows, header = _rows(doc, sinks, labels), labels
    # a raw lane (`raw:URL`) belongs to its sink URL
    gone = [s for s in sinks if doc["sinks"] and s.removeprefix(RAW_LANE_PREFIX) not in doc["sinks"]]
    if any(header[s] != s for s in sinks) or gone:
        for s in sinks:
            note = "  (no longer a --sink: left as it was)" * (s in gone)
            console.print(f"{escape(header[s])} {escape(s)}{escape(note)}", overflow="fold")
    for drop in range(len(OPTIONAL) + 1):
        kept = [c for c in optional if c[0] not in OPTIONAL[:drop]]
        chosen = base + kept + [(f"sink:{s}", header[s]) for s in sinks]
        if _room_for_error(chosen, rows, width) >= _MIN_ERROR_WIDTH:
            break
    else:  # many sinks: each lane's time or tries goes under its state, a step takes two lines
        rows = _rows(doc, sinks, labels, gap="\n")
    room = _room_for_error(chosen, rows, width)
    errors = room >= len("error") or not any(r["error"] for r in rows)  # else only in full, below
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, expand=False)
    for (key, title), w in zip(chosen, _widths(chosen, rows), strict=True):
        right = key in ("step", "age", "export", "size")
        table.add_column(
            escape(title),
            justify="right" if right else "left",
            no_wrap=True,
            overflow="ellipsis",
            min_width=w,
        )
    if errors:
        room = max(room, len("error"))
        table.add_column("error", no_wrap=True, overflow="ellipsis", max_width=room)
    for row in rows:
        table.add_row(*(row[key] for key, _ in chosen), *[_clip(row["error"], room)] * errors)
    if rows:  # a table of headers only (every step retired, none listed) says nothing
        console.print(table)
    counts = ", ".join(f"{n} {k}" for k, n in doc["counts"].items() if n)
    hidden = not rows and (doc["counts"].get("retired") or doc["counts"].get("lost"))  # listed with --all
    listed = " (`stagerd status --all` lists retired steps)"
    console.print((counts or "no steps yet") + listed * bool(hidden))
    waiting = [(s["step"], w) for s in doc["steps"] for w in _waits(s, labels)]
    if waiting:
        console.print("\nwaiting:")
        for step, (where, text) in waiting:
            place = f" {where}" if where else ""
            console.print(escape(f"  step {step}{place}: {text}"), overflow="fold")
    failed = [(s["step"], e) for s in doc["steps"] for e in _errors(s, labels, full=True)]
    if failed:
        console.print("\nerrors:")
        for step, (where, cls, message, hint) in failed:
            place = f" {where}" if where else ""
            console.print(escape(f"  step {step}{place}: {cls}: {message or ''}"), overflow="fold")
            if hint:  # the operator of a running daemon never saw the log line that said it
                console.print(escape(f"    hint: {hint}"), overflow="fold")
    if any(_stuck(s, given_up=True) for s in doc["steps"]):
        console.print(escape(f"what to do: {given_up_hint()}"), overflow="fold")
    if any(_stuck(s) for s in doc["steps"]):
        console.print(
            escape(
                f"what to do: a quarantined step stays so, even across restarts of `stagerd watch`; fix its "
                f"cause, then `stagerd retry {doc['root']}` (or --step N)"
            ),
            overflow="fold",
        )


def _stuck(step: dict[str, Any], *, given_up: bool = False) -> bool:
    """Whether the step or a lane is quarantined for good; with `given_up`, whether one waits only because a
    `--once` run stopped trying (ran out of tries of a failure that may pass, or found its sink down or
    missing), which the next start tries again."""
    rows = [step, *step["lanes"]]
    if given_up:
        return any(_left_waiting(r) or _given_up(r["state"], r["error_class"]) for r in rows)
    return any(r["state"] == "quarantined" and not _given_up(r["state"], r["error_class"]) for r in rows)
