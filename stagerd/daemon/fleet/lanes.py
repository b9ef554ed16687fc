"""The fsspec sinks one node's fleet run publishes to, each its own lane as a single daemon's publish lanes
are: a sink that fails on this node (an upload, a commit, or the leader's record that it left the sink to
its lane) is dropped from the run with its named error, recorded on the exchange for the nodes waiting on
it, while every other sink goes on; the run fails only once every sink of it failed."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from stagerd.contract import layout
from stagerd.contract.manifest import MAX_MANIFEST_BYTES
from stagerd.daemon.fleet.broken import broken_of
from stagerd.daemon.fleet.exchange import RECORDS_DIR, StepExchange
from stagerd.daemon.fleet.records import sink_id
from stagerd.errors import SinkError, StagerdError
from stagerd.sinks.fsspec import FsspecSink
from stagerd.sinks.objects import parse_manifest

log = logging.getLogger("stagerd.fleet")


def committed_files(sinks: Sequence[FsspecSink], step: int) -> list[tuple[str, int]]:
    """The files of `step` and their sizes (the manifest aside) as the first of `sinks` that holds it lists
    them: the whole export, every node's files, that each node reports as its export (`stagerd status`, the
    log); none where no sink's manifest can be read (a report, not the step's outcome)."""
    key = f"{layout.step_dir_name(step)}/{layout.MANIFEST_NAME}"
    for sink in sinks:
        try:
            data = sink.backend.read(key, MAX_MANIFEST_BYTES + 1)
            if data is not None:
                manifest = parse_manifest(data, f"{sink.url}/{key}")
                return [(f.path, f.size) for f in manifest.files if f.path != layout.MANIFEST_NAME]
        except (SinkError, OSError):
            continue
    return []


def published(sink: FsspecSink, step: int) -> bool:
    """`sink` holds `step`; False where it cannot be read: the work on it then names that, per sink."""
    try:
        return sink.is_published(step)
    except SinkError:
        return False


class Lanes:
    def __init__(self, x: StepExchange, sinks: Sequence[FsspecSink]) -> None:
        self.x, self.all = x, list(sinks)
        self.failed: dict[str, StagerdError] = {}  # sink URL -> the error that stopped it on this run

    def live(self) -> list[FsspecSink]:
        return [s for s in self.all if s.url not in self.failed]

    def fail(self, sink: FsspecSink, err: StagerdError) -> None:
        """Drop `sink` from this run (its lane tries it again) and say so on the exchange."""
        self.failed[sink.url] = err
        x = self.x
        log.warning(
            "step %d: fleet node %d leaves sink %s to its own lane: %s",
            x.step,
            x.me,
            sink.url,
            err,
            extra={"step": x.step, "fleet_node": x.me, "sink": sink.url},
        )
        x.record_failure(sink, err)

    def check(self) -> None:
        """Every sink of this run failed: nothing is left to do but fail, with the first sink's error."""
        if self.all and not self.live():
            raise self.failed[self.all[0].url]

    def wait_leader(self, owner: dict[str, int]) -> None:
        """Until the leader has committed every sink of this run, but those it left to their lanes (its
        record of the failure, `StepExchange.failure_of`) or that fail here: dropped, as `_build` drops one.
        Its text counts what the leader is seen doing: every file's record on each sink (its own builds, and
        the other owners' it waits for), the reports (`Progress`) of the leader and of the owners of files
        not yet recorded, and each sink's commit; so the wait fails only once the leader (or an owner it
        waits for) makes no progress for the setting. A node stopped by an error no retry mends
        (`broken.broken_of`), the leader or an owner, stops this node too."""
        x, live = self.x, self.live()
        want = {f"{sink_id(s.url)}/{n}.json": owner[n] for s in live for n in owner}
        committed = [0]

        def committed_all() -> bool:
            if (stopped := broken_of(x, range(x.nodes))) is not None:  # a node quarantined the step
                raise stopped
            done = 0
            for s in live:
                if s.url in self.failed:
                    continue
                try:
                    if s.is_published(x.step):
                        done += 1
                        continue
                    why = x.failure_of(s, [0])  # the leader left it to its lane
                except SinkError as e:
                    why = e
                if why is not None:
                    self.fail(s, why)
            self.check()
            committed[0] = done
            return done == sum(s.url not in self.failed for s in live)

        def what() -> str:
            gone = want.keys() - x.store.sizes(f"{x.base}/{RECORDS_DIR}").keys()
            doing = x.progress_of(sorted({0} | {want[k] for k in gone}))
            sinks = f"{committed[0]} of {len(live)} sinks committed"
            done = f"{len(want) - len(gone)} of {len(want)} files recorded"
            return f"waiting for the leader (node 0: {done}, {sinks}{doing})"

        x.wait(committed_all, what)
