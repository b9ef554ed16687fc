"""What `stagerd watch` says at its start and end about a ROOT that will not make progress by itself:
quarantined steps that only `stagerd retry` re-arms, a trainer's own checkpoints without --adopt, the
adopted checkpoints the trainer deleted before they were exported, and a --keep-last 0 that leaves ROOT
empty."""

from __future__ import annotations

import logging
import os
from collections.abc import Collection
from pathlib import Path

log = logging.getLogger("stagerd")


def retry_hint(root: Path) -> str:
    return (
        "a quarantined step is never tried again by itself, not even by a new `stagerd watch`: fix its "
        f"cause (`stagerd status {root}` shows it), then `stagerd retry {root}`"
    )


def given_up_hint() -> str:
    return (
        "a failure that may pass (a sink down, a full disk) ends a --once run after --max-attempts tries, "
        "one that waits for a fix (a missing bucket, a refused token) after one; the next `stagerd watch` "
        "tries those steps again by itself"
    )


def quarantined_steps(
    root: Path, lanes: Collection[str], *, adopted: bool = False, export_dir: Path | None = None
) -> list[int]:
    """The steps ROOT's journal holds quarantined for good, the step or one of its lanes of the sinks this
    start was given (`lanes`; a lane of a sink since dropped from the command line is never worked on, as
    the `--once` summary says); none without a journal. Not those a `--once` run gave up on after its tries
    of a failure that may pass: this start re-arms them, so telling the user to run `stagerd retry` would be
    wrong. With `adopted` (`--adopt`, its exports under `export_dir` where given), nor a step this start
    retires as lost: its checkpoint gone, no sink has any of it, and no whole export of it is left, as the
    daemon tells (`gone_unexported`); one whose whole export is left is still published from it."""
    from stagerd.contract.adopt.gone import gone_unexported
    from stagerd.daemon.journal import PUBLISHED, QUARANTINED, Journal, journal_path
    from stagerd.daemon.policy import given_up
    from stagerd.daemon.root_places import adopt_root
    from stagerd.errors import JournalError

    if not journal_path(root).is_file():
        return []
    try:
        journal = Journal.open_readonly(root)
    except JournalError:
        return []
    try:
        all_lanes = journal.lanes(include_retired=False)
        sent = {ln.step for ln in all_lanes if ln.state == PUBLISHED}
        work = adopt_root(root, export_dir)
        rows: list[tuple[int, str, str | None]] = [
            (s.step, s.state, s.error_class)
            for s in journal.steps(include_retired=False)
            if not adopted or s.step in sent or not gone_unexported(Path(s.path), work / Path(s.path).name)
        ]
        rows += [(ln.step, ln.state, ln.error_class) for ln in all_lanes if ln.sink in lanes]
        steps = {step for step, state, cls in rows if state == QUARANTINED and not given_up(state, cls)}
    finally:
        journal.close()
    return sorted(steps)


def warn_quarantined(
    root: Path, lanes: Collection[str], *, adopted: bool = False, export_dir: Path | None = None
) -> None:
    """A user who fixed a token and starts the daemon again expects the steps it refused to go out now;
    they stay quarantined until `stagerd retry`, so say so at the start rather than let it look stuck. The
    daemon calls this holding ROOT's lock, its sinks open: `lanes` are their lanes."""
    steps = quarantined_steps(root, lanes, adopted=adopted, export_dir=export_dir)
    if steps:
        shown = ", ".join(map(str, steps[:10])) + (", ..." if len(steps) > 10 else "")
        log.warning("%d step(s) quarantined in the journal (%s); %s", len(steps), shown, retry_hint(root))


def warn_keep_none(keep_last: int | None, publish_raw: bool, *, trainer_kept: bool = False) -> None:
    """`--keep-last 0` is meant (every staged step goes once published, the newest too), but a user who read
    "unset: delete nothing" may type 0 for "off", and find nothing in ROOT to resume from. Said once, at the
    start. Not where only stagerd's own exports of adopted checkpoints go (`trainer_kept`): the trainer's
    checkpoints stay then."""
    if keep_last != 0 or trainer_kept:
        return
    if publish_raw:
        log.warning(
            "--keep-last 0: every step's staged data is deleted once published, the newest too "
            "(`stagerd restore` brings a step back from its --publish-raw copy)"
        )
        return
    log.warning(
        "--keep-last 0: every step's staged data is deleted once published, the newest too; without "
        "--publish-raw its optimizer state is gone for good, so training cannot resume from it. "
        "--keep-last 1 keeps the newest"
    )


def warn_unadopted(root: Path) -> None:
    """Checkpoints a trainer saved itself, and no step saved through stagerd.Stager: without --adopt the
    daemon waits for Stager steps that never come, and a --once run reports "0 step(s)" as a success."""
    from stagerd.contract import layout

    trainer_files = (".metadata", "trainer_state.json", layout.WEIGHTS_NAME, layout.INDEX_NAME)
    try:
        names = sorted(os.listdir(root))
    except OSError:
        return
    if any(layout.parse_step_dir(n) is not None for n in names):
        return
    found = []
    for n in names:
        d = root / n
        if n.startswith(".") or not d.is_dir():
            continue
        inner = [d, *(c for c in _subdirs(d))]
        if any((c / f).is_file() for c in inner for f in trainer_files):
            found.append(n)
    if found:
        shown = ", ".join(found[:3]) + (", ..." if len(found) > 3 else "")
        log.warning(
            "%s holds checkpoints a trainer saved itself (%s) and no step saved through stagerd.Stager: "
            "they are exported only with --adopt (see `stagerd watch --help`)",
            root,
            shown,
        )


def _subdirs(d: Path) -> list[Path]:
    try:
        return [d / n for n in os.listdir(d) if (d / n).is_dir()]
    except OSError:
        return []
