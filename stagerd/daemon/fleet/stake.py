"""The fleet's claim of each sink's step, made before any node writes under that sink's `step-N/`: a step
another publisher claimed (another ROOT, a second run on the same prefix) is not the fleet's, so no owner
may upload into it.

The leader (node 0), once every node's claim is on the exchange and the settings are agreed, claims the
step on each sink of its run with the claim its commit records (`claims.fleet_claim`, naming every node's
ROOT: `StepExchange.claim_step`) and records what the sink then holds on the exchange
(`fleet/step-N/claimed/SINK.json`). Every owner, before its first upload to a sink, waits for that record
and checks the sink still holds that claim (`StepExchange.claim_error`): a node that is not the leader
cannot make the leader's claim itself (its ROOT's identity, host and path), but can compare bytes. A sink
the leader could not claim is left to its lane on the leader, and then on every owner, with the
`StepClaimedError` naming the holder: nothing of the fleet is written there, the other sinks go on. A step a
sink already holds complete is never written into: the fleet's own (an earlier try's commit) is recorded as
complete, and owners skip it; another publisher's is `SinkConflictError` on every node."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path

from stagerd.daemon.fleet.exchange import StepExchange
from stagerd.daemon.fleet.records import sink_id
from stagerd.errors import SinkConflictError, SinkError, StagerdError
from stagerd.sinks.claims import Claim, fleet_claim
from stagerd.sinks.fsspec import FsspecSink

CLAIMED_DIR = "claimed"  # one record per sink: the leader holds the step's claim there

Fail = Callable[[FsspecSink, StagerdError], None]


def publisher(x: StepExchange, step_dir: Path) -> Claim:
    """The leader's claim of the export: who published it, for remote retention on every node; each node's
    ROOT as its claim on the exchange names it."""
    roots = [str((x.read_json(x.claim_key(k)) or {}).get("root", "")) for k in range(x.nodes)]
    return fleet_claim(step_dir, roots)


def claimed_key(x: StepExchange, sink: FsspecSink) -> str:
    return f"{x.base}/{CLAIMED_DIR}/{sink_id(sink.url)}.json"


def stake(x: StepExchange, mine: Claim, sinks: Sequence[FsspecSink], failed: Fail) -> None:
    """Leader: claim the step on each of `sinks` with `mine` (`publisher`) and record the claim held there;
    a sink that refuses (another publisher's claim, a dead store) is `failed`, which the owners waiting on
    it read."""
    for sink in sinks:
        try:
            # A step the sink holds complete is written no more: the fleet's own (a leader killed between
            # two sinks' commits) needs only `latest`; another publisher's is its conflict.
            held = x.committed_here(sink, mine)
            complete = held is not None
            if held is None:
                held = x.claim_step(sink, mine)
        except SinkError as e:
            failed(sink, e)
            continue
        key = claimed_key(x, sink)
        data = json.dumps({"claim": held.decode(errors="replace"), "complete": complete}).encode()
        x.write(key, data)  # overwritten: a claim made again after a prune replaces it


class Stakes:
    """The sinks this node saw the fleet's claim of in this run: checked once, before the first upload."""

    def __init__(self, x: StepExchange, failed: Fail) -> None:
        self.x, self.failed = x, failed
        self.seen: set[str] = set()
        self.complete: set[str] = set()  # the step is already there: nothing is uploaded to it

    def ready(self, sinks: Sequence[FsspecSink]) -> list[FsspecSink]:
        """Those of `sinks` whose step is the fleet's to write: waits until the leader recorded its claim of
        each, found the step complete there (nothing to upload), or left it to its lane (`failure_of`). A
        sink whose claim is another publisher's, or the leader's failure, is `failed` here too and
        dropped."""
        x, todo = self.x, [s for s in sinks if s.url not in self.seen | self.complete]
        held: dict[str, bytes] = {}
        gone: dict[str, StagerdError] = {}

        def decided() -> bool:
            for s in todo:
                if s.url in held or s.url in gone:
                    continue
                rec = x.read_json(claimed_key(x, s))
                if rec is not None and rec.get("complete") is True:
                    self.complete.add(s.url)
                elif rec is not None:
                    held[s.url] = str(rec.get("claim", "")).encode()
                elif (why := x.failure_of(s, [0])) is not None:
                    gone[s.url] = why
            return all(s.url in held or s.url in gone or s.url in self.complete for s in todo)

        def waiting() -> str:  # the count, and the leader's reports, are its progress
            known = sum(s.url in held or s.url in gone or s.url in self.complete for s in todo)
            return (
                f"waiting for the leader (node 0: {known} of {len(todo)} sinks claimed{x.progress_of([0])})"
            )

        x.wait(decided, waiting)
        for s in todo:
            if s.url in self.complete:
                continue
            if isinstance(gone.get(s.url), SinkConflictError):  # another's complete step: the leader's word
                self.failed(s, gone[s.url])
                continue
            try:  # the leader's failure is named by the claim that caused it, where another holds one
                why: StagerdError | None = x.claim_error(s, held.get(s.url)) or gone.get(s.url)
            except SinkError as e:
                why = gone.get(s.url, e)
            if why is None and s.url in held:
                try:
                    # a past try's record (the new try's may not be written yet) of a step that try
                    # committed since: the fleet's complete step, never written into, whatever files
                    # this try's plan names (an older build's plan may name others)
                    if x.committed(s):
                        self.complete.add(s.url)
                        continue
                except SinkError as e:
                    why = e
            if why is None:
                self.seen.add(s.url)
            else:
                self.failed(s, why)
        return [s for s in sinks if s.url in self.seen]
