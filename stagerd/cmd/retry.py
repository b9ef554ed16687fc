"""`stagerd retry ROOT [--step N] [--sink URL]`: re-arm what the daemon stopped trying.

A step or lane is quarantined when its attempts ran out, when a failure cannot pass by itself, or when a
step was saved again after it was published (a `StepConflictError`). Once the cause is fixed, `retry` puts
it back to work with its attempts reset. Safe while the daemon runs: it writes the journal, which the
daemon reads on every scheduling pass (about once a second), and a stopped daemon picks it up at its
next start.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from stagerd.cmd.help import UserHelpFormatter
from stagerd.errors import ConfigError

EXAMPLES = """examples:
  stagerd retry /scratch/run1               # every failed or quarantined one
  stagerd retry /scratch/run1 --step 1200   # one step
  stagerd retry /scratch/run1 --step 1200 --sink s3://ckpts/run1
"""


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser], name: str) -> None:
    p = sub.add_parser(
        name,
        help="put failed or quarantined steps back to work once their cause is fixed",
        description=(
            "Re-arm failed and quarantined steps and sink lanes in ROOT's journal, with their attempts "
            "reset. A step quarantined because it was saved again after it was published "
            "(StepConflictError) adopts its new save, which is then exported and published to every sink: "
            "remove the old step from each sink first, or the sink refuses it as a conflict."
        ),
        epilog=EXAMPLES,
        formatter_class=UserHelpFormatter,
    )
    p.add_argument("root", type=Path, metavar="ROOT", help="the staging root `stagerd watch` runs on")
    p.add_argument("--step", type=int, metavar="N", help="only this step (default: every stuck one)")
    p.add_argument("--sink", metavar="URL", help="only this sink's lanes, as `stagerd status` names it")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from stagerd.cmd.status import check_journal
    from stagerd.contract import layout
    from stagerd.daemon.journal import Journal, LaneState, StepState

    # Journal.open sets up any table missing: a damaged journal (or an unrelated SQLite file) would be
    # rebuilt empty, its lanes' states lost. Only a journal `status` reads is written, and what is checked
    # is what that read found: the write below re-checks each state inside its own transaction.
    rows, lanes = check_journal(args.root)
    steps = {r.step: r for r in rows}
    sinks = [None] if args.sink is None else lanes_named(args.sink, {ln.sink for ln in lanes})
    if not sinks:
        known = ", ".join(sorted({ln.sink for ln in lanes})) or "none yet"
        raise ConfigError(f"no sink {args.sink!r} in this journal", hint=f"the sinks it knows: {known}")
    if args.step is not None and args.step not in steps:
        _refuse_lost(args.root, args.step)
        raise ConfigError(
            f"step {args.step} is not a live step of this journal",
            path=args.root,
            hint="`stagerd status ROOT --all` lists the steps the daemon knows",
        )
    stuck_lanes = {ln.step for ln in lanes if ln.state in (LaneState.FAILED, LaneState.QUARANTINED)}
    wanted = [
        r
        for r in steps.values()
        if (args.step is None or r.step == args.step)
        and (r.state in (StepState.FAILED, StepState.QUARANTINED) or r.step in stuck_lanes)
    ]
    for r in wanted:
        # A step the Stager wrote (its name, its model/) is there once committed. An adopted checkpoint
        # (`watch --adopt`) is the trainer's own directory, never committed with a marker, and may be
        # named as the Stager names steps: it is there to export again while it is there at all.
        path = Path(r.path)
        ours = path.name == layout.step_dir_name(r.step) and (path / layout.MODEL_DIR).is_dir()
        there = layout.is_committed(path) if ours else path.is_dir()
        if r.state is not StepState.EXPORTED and not there:
            raise ConfigError(
                f"step {r.step}'s staged data is gone ({r.path}): there is nothing to export again",
                path=r.path,
                hint="restore the step directory first, or leave the step quarantined (an adopted checkpoint "
                "its trainer deleted is retired as lost at the daemon's next start)",
            )
    done: list[str] = []
    if wanted:
        journal = Journal.open(args.root)
        try:
            done = [line for r in wanted for sink in sinks for line in journal.retry(r.step, sink)]
        finally:
            journal.close()
    if not done:
        print("nothing to retry: no failed or quarantined step or lane matched")
        return 0
    for line in done:
        print(f"re-armed {line}")
    return 0


def _refuse_lost(root: Path, step: int) -> None:
    """A ConfigError for a step retired as lost: the trainer deleted its checkpoint before it was exported,
    so there is nothing to retry, and nothing to mend."""
    from stagerd.daemon.journal import Journal
    from stagerd.daemon.journal.schema import LOST, LOST_NOTE
    from stagerd.daemon.unadopted import LOST_HINT

    journal = Journal.open_readonly(root)
    try:
        row = journal.step(step)
    finally:
        journal.close()
    if row is not None and row.error_class == LOST:
        raise ConfigError(
            f"step {step} is lost: {LOST_NOTE}, so there is nothing to export or publish again",
            path=row.path,
            hint=f"nothing to mend; {LOST_HINT}",
        )


def lanes_named(given: str, keys: set[str]) -> list[str]:
    """The journal's lane keys that name the sink `given` names, spelt either way: the daemon keys a lane by
    its sink URL as given to it, without trailing slashes (`raw:URL` for a raw lane), so `file:///x`,
    `file:///x/` and `/x` are one sink, as `--sink` takes them (`SinkUrl.place`)."""
    from stagerd.daemon.journal.raw import RAW_LANE_PREFIX

    raw, want = given.startswith(RAW_LANE_PREFIX), _place(given.removeprefix(RAW_LANE_PREFIX))
    return sorted(
        k
        for k in keys
        if k.startswith(RAW_LANE_PREFIX) == raw and _place(k.removeprefix(RAW_LANE_PREFIX)) == want
    )


def _place(url: str) -> tuple[str, ...]:
    from stagerd.sinks.objects import redact_url
    from stagerd.sinks.urls import parse_sink_url

    text = redact_url(url.rstrip("/"))  # as the daemon names its lanes (`FsspecSink.url`)
    try:
        return parse_sink_url(text).place
    except ConfigError:  # a lane of a scheme no longer installed, or a redacted password: as spelt
        return (text,)
