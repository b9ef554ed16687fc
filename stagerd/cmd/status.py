"""`stagerd status ROOT [--json]`: what the daemon did with each step, per sink, with timings and errors.

Reads the journal read-only, so it works while the daemon runs, and on a read-only ROOT; it never imports
torch.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from stagerd.cmd.help import UserHelpFormatter
from stagerd.errors import JournalError

EXAMPLES = """examples:
  stagerd status /scratch/run1
  stagerd status /scratch/run1 --all           # retired steps too
  stagerd status /scratch/run1 --json | jq '.steps[] | .state'
"""


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser], name: str) -> None:
    p = sub.add_parser(
        name,
        help="show each step's state per sink, with timings, sizes and errors",
        description=(
            "Show what `stagerd watch` did with every step in ROOT: one line per step with its state on "
            "each sink, then the full text of every error. Safe while the daemon runs. --json prints "
            "everything, for scripts."
        ),
        epilog=EXAMPLES,
        formatter_class=UserHelpFormatter,
    )
    p.add_argument("root", type=Path, metavar="ROOT", help="the staging root `stagerd watch` runs on")
    p.add_argument("--json", action="store_true", help="one complete JSON document, for scripts")
    p.add_argument("--all", action="store_true", help="include retired steps")
    p.set_defaults(func=run)


_Read = tuple[
    dict[str, Any],
    list[Any],
    list[Any],
    dict[str, int],
    dict[int, dict[str | None, str]],
    dict[str, tuple[int, list[int]]],
    int,
]


def refuse_no_root(root: Path) -> None:
    """A JournalError for a ROOT missing or not a directory (`status`, and `retry` before it writes)."""
    if not root.is_dir():
        from stagerd.contract.layout import closest_existing

        what = "is not a directory" if root.exists() else "does not exist"
        meant = None if root.exists() else closest_existing(root)  # a typo of the ROOT beside it
        raise JournalError(
            f"ROOT {what}, so there is no journal to read",
            path=root,
            hint=(f"did you mean {meant}? Else g" if meant else "g") + "ive the ROOT `stagerd watch` runs on",
        )
    from stagerd.daemon.root_places import refuse_a_step_or_state_dir

    refuse_a_step_or_state_dir(root, "stagerd status {root}")  # never "start `stagerd watch` there"


def check_journal(root: Path) -> tuple[list[Any], list[Any]]:
    """The JournalError `status` gives for ROOT's journal (missing, damaged, an unrelated file, another
    schema), read-only: what writes it (`retry`) must refuse such a journal, not set its tables up anew.
    Its live steps and their lanes, as read."""
    refuse_no_root(root)
    _, steps, lanes, *_ = _read_journal(root, include_retired=False)
    return steps, lanes


def _read_journal(root: Path, *, include_retired: bool) -> _Read:
    from stagerd.daemon.journal import Journal
    from stagerd.daemon.summary import NEWEST_LISTED

    journal = Journal.open_readonly(root)
    try:
        meta = journal.meta()
        return (
            meta,
            journal.steps(include_retired=include_retired),
            journal.lanes(include_retired=include_retired),  # never read what is not shown
            journal.counts(),
            journal.waits(),
            # the retired steps a sink of the last run never got (retired before it was configured)
            journal.missed(meta.get("lanes", meta.get("sinks", [])), NEWEST_LISTED),
            journal.lost_summary(0)[0],  # of the retired steps, those lost: counted apart
        )
    finally:
        journal.close()


def _read_a_copy(root: Path, *, include_retired: bool) -> _Read:
    """SQLite must create the journal's -shm file to read it, which a read-only ROOT forbids. No -shm means
    no connection is open, so no daemon is writing and a copy is a consistent snapshot."""
    from stagerd.daemon.journal import journal_path

    src = journal_path(root)
    with tempfile.TemporaryDirectory(prefix="stagerd-status-") as tmp:
        dst = journal_path(tmp)
        dst.parent.mkdir(parents=True)
        try:
            for suffix in ("", "-wal"):
                if Path(f"{src}{suffix}").exists():
                    shutil.copyfile(f"{src}{suffix}", f"{dst}{suffix}")
        except OSError as e:
            raise JournalError(
                f"cannot read the journal: {e.strerror}",
                path=src,
                hint="run `stagerd status` as the user that runs `stagerd watch` (or as root)",
            ) from None
        return _read_journal(Path(tmp), include_retired=include_retired)


ADOPTABLE_SHOWN = 3


def adoptable(root: Path) -> list[str]:
    """The first few of ROOT's directories that hold a checkpoint an `--adopt` preset recognises, where ROOT
    holds no step saved through stagerd.Stager (whose step directories a preset may read too)."""
    from stagerd.contract import layout
    from stagerd.contract.adopt.presets import AUTO
    from stagerd.engine.adopt.detect import choose_preset
    from stagerd.errors import StagerdError

    try:
        names = sorted(os.listdir(root))
    except OSError:
        return []
    if any(layout.parse_step_dir(n) is not None for n in names):
        return []
    found: list[str] = []
    for name in names:
        d = root / name
        if name.startswith(".") or not d.is_dir():
            continue
        try:
            choose_preset(d, AUTO)
        except (StagerdError, OSError):
            continue
        found.append(name)
        if len(found) == ADOPTABLE_SHOWN:
            break
    return found


def _adopt_hint(e: JournalError, root: Path, found: list[str]) -> JournalError:
    """`e` (no journal: no daemon started there yet) with its hint to start the daemon given `--adopt`:
    without it, the daemon waits for Stager steps that never come."""
    shown = ", ".join(found) + (", ..." if len(found) == ADOPTABLE_SHOWN else "")
    start = f"`stagerd watch {root} --adopt --sink URL`"
    hint = (e.hint or "").replace(f"`stagerd watch {root} --sink URL`", start)
    if start not in hint:
        hint = f"start {start}" + (f"; {hint}" if hint else "")
    return JournalError(
        e.message,
        path=e.path,
        hint=f"{hint} (ROOT holds checkpoints a trainer saved itself: {shown}; --adopt exports them)",
    )


def _cannot_write(directory: Path) -> bool:
    try:
        read_only_fs = bool(os.statvfs(directory).f_flag & os.ST_RDONLY)
    except OSError:
        return False
    return read_only_fs or not os.access(directory, os.W_OK)


def collect(root: Path, *, include_retired: bool) -> dict[str, Any]:
    """The status document: daemon, disk, and every step with its lanes."""
    from stagerd.contract.step.pin import pinned
    from stagerd.daemon.journal import FAILED, RETIRED, journal_path
    from stagerd.daemon.journal.schema import LOST
    from stagerd.daemon.lock import root_holder
    from stagerd.daemon.policy import failure_hint
    from stagerd.daemon.retention import disk_state
    from stagerd.daemon.trainers_best import staged_best
    from stagerd.daemon.unadopted import LOST_HINT

    refuse_no_root(root)
    note = None
    try:
        meta, steps, lanes, counts, waits, missed, lost = _read_journal(root, include_retired=include_retired)
    except JournalError as e:
        path = journal_path(root)
        if not path.is_file() and (found := adoptable(root)):
            raise _adopt_hint(e, root, found) from None
        if not (path.is_file() and _cannot_write(path.parent)):
            raise
        meta, steps, lanes, counts, waits, missed, lost = _read_a_copy(root, include_retired=include_retired)
        note = f"{path.parent} is read-only for this user: read from a copy of the journal"
    holder = root_holder(root)
    disk = disk_state(
        root,
        low_percent=float(meta.get("low_disk_free_percent", 10.0)),
        low_bytes=int(meta.get("low_disk_free_bytes", 0)),
    )
    by_step: dict[int, list[dict[str, Any]]] = {}
    for ln in lanes:  # a lane's "waiting": a Hub lane of a fleet step, for the leader's publish
        d = {**asdict(ln), "waiting": waits.get(ln.step, {}).get(ln.sink)}
        d["state"] = _shown_state(d)
        d["error_hint"] = ln.error_class and failure_hint(ln.error_class, ln.error_hint)
        by_step.setdefault(ln.step, []).append(d)
    now = time.time()
    best = staged_best(root)
    out_steps = []
    for s in steps:
        d = asdict(s)
        # what to do: the failure's own hint, else (one recorded by an older stagerd) its class's
        d["error_hint"] = s.error_class and failure_hint(s.error_class, s.error_hint)
        if s.state == RETIRED and s.error_class == LOST:  # its trainer deleted it unexported: never published
            d["state"], d["error_hint"] = "lost", d["error_hint"] or LOST_HINT
        d["path"] = str(root / Path(s.path).name)  # a copy of the journal would place it in the copy's dir
        d["lanes"] = by_step.get(s.step, [])
        d["waiting"] = waits.get(s.step, {}).get(None)  # a fleet step: "waiting for node k (seen: ...)"
        if (d["state"], shown := _shown_state(d)) == (FAILED, WAITING):
            counts = {**counts, FAILED: counts.get(FAILED, 0) - 1, WAITING: counts.get(WAITING, 0) + 1}
            d["state"] = shown
        d["age_seconds"] = round(now - s.marker_mtime, 3)
        # retention keeps it while a trainer holds it, or while the newest step names it best (the HF
        # Trainer's or Lightning's)
        d["pinned"] = s.state != RETIRED and (s.step in best or pinned(root, s.step))
        out_steps.append(d)
    return {
        "root": str(root),
        "daemon_pid": holder.pid if holder else None,
        "holder": holder.command if holder else None,  # `restore` takes the lock too
        # held by a process of another pid namespace (the next container of a pod): no pid to show here
        "held_elsewhere": holder is not None and holder.pid is None,
        "sinks": meta.get("sinks", []),
        "keep_last": meta.get("keep_last"),
        "disk": {
            "free": disk.free,
            "total": disk.total,
            "free_percent": round(disk.free_percent, 2),
            "low": disk.low,
        },
        # a lost step (retired unpublished: its checkpoint deleted before it was exported) is not "retired"
        "counts": {**counts, "retired": counts.get("retired", 0) - lost, "lost": lost},
        "missed": {sink: {"count": n, "newest": newest} for sink, (n, newest) in missed.items()},
        # the saves the daemon's last scan left alone as unfinished: {count, newest: [[step, name, rule]],
        # adopt}; None before a daemon of this version scanned ROOT
        "unfinished": meta.get("unfinished"),
        "steps": out_steps,
        "note": note,
    }


WAITING = "waiting"


def _shown_state(row: dict[str, Any]) -> str:
    """A step or lane failed while it waits (a fleet step for another node, a Hub lane for the leader's
    publish) is shown waiting: it is tried again, never quarantined for it (`--once` left it for the next
    start: `next_try` None, as for any failure left waiting)."""
    from stagerd.daemon.journal import FAILED

    return WAITING if row["state"] == FAILED and row.get("waiting") else str(row["state"])


def run(args: argparse.Namespace) -> int:
    doc = collect(args.root, include_retired=args.all)
    if args.json:
        json.dump(doc, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        from stagerd.cmd.status_table import render

        render(doc)
    return 0
