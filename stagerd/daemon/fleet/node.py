"""One node's part of a fleet export: node-local ROOTs, one HF export built together through the exchange.

The protocol (ARCHITECTURE.md, "Multi-node export without a shared filesystem"), for node k of M:

1. claim `fleet/step-N/node-K.json` on the exchange (`claim.py`: a conditional create naming this ROOT's
   identity; a claim by another ROOT is `FleetNodeConflictError`), then publish the raw part to
   `raw/step-N/node-K-of-M/` (manifest last): the exchange's input and the raw backup restore reads;
2. wait until every node's raw manifest is there ("waiting for node j (seen: ...)"), each of this save
   (`parts.py`);
3. plan from every node's marker and shard headers (`fleet_plan.Mirror`): the single-node plan, byte for
   byte, and a PEFT adapter's (`fleet_build.Artefact`); owners by bytes (`fleet_plan.owners`). Before
   that the leader (node 0) claims the step on every sink (`fleet/stake.py`: the export's claim, naming
   every node's ROOT, for remote retention) and records each claim on the exchange
   (`fleet/step-N/claimed/SINK.json`): a step another publisher claimed is not the fleet's;
4. for each file it owns that some sink has no record of: wait for the leader's record of each such sink's
   claim and check the sink holds it (once a run: another's claim, or the leader's failure, fails the
   sink here, nothing written there), fetch the byte ranges its moves read (and compute the LoRA merges
   it reads, from their fetched inputs), build it once with `execute`, and for each such sink upload it
   under the sink's `step-N/`, then create `fleet/step-N/done/SINK/NAME.json` (size, sha256, that
   store's checksum; SINK names the sink URL);
5. the leader, sink by sink, uploads the index and extras, waits for every file's record, and commits
   through `FsspecSink.commit_uploaded` (listing and checksums verified, manifest last, `latest`:
   `fleet/lead.py`; its claim of 3 checked again, and kept, just before);
   the others wait for every sink's manifest. A dead node's files are not reassigned: the step waits for it
   (`FleetWaitError`).

With several fsspec sinks each owner uploads its files to every one (each node still sends about 1/N of
every sink's bytes) and each sink gets its own commit, so every sink ends with the same export. Each sink is
its own lane, as for one daemon: a sink that fails on a node (the leader's claim, an upload, the commit)
is dropped from that node's run with its `SinkError` (`FleetResult.failed`) and a record of it on the
exchange (`fleet/step-N/failed/SINK/node-K.json`), so that the leader commits every other sink as soon as
its files are there, and the nodes waiting on the failed sink stop; the sink's lane then runs this
protocol for it alone (`lanes`), retried as any publish is. `done.json` waits for every sink's commit: a
sink's lane still reads the raw parts.
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stagerd.contract import commit_marker, layout
from stagerd.contract.dtypes import parse_export_dtype
from stagerd.contract.layout import ADAPTER_DIR, ADAPTER_WEIGHTS_NAME
from stagerd.contract.reference_index import load_weight_map
from stagerd.contract.sharding import FLEET_MAX_SHARD_SIZE
from stagerd.daemon.fleet import broken
from stagerd.daemon.fleet.build import Artefact
from stagerd.daemon.fleet.claim import claim, wait_agreed
from stagerd.daemon.fleet.exchange import StepExchange
from stagerd.daemon.fleet.hub import all_hubs_recorded
from stagerd.daemon.fleet.lanes import Lanes, committed_files, published
from stagerd.daemon.fleet.lead import lead
from stagerd.daemon.fleet.parts import wait_parts
from stagerd.daemon.fleet.plan import Mirror, check_extras, owners
from stagerd.daemon.fleet.progress import Progress
from stagerd.daemon.fleet.records import planned_file, record_bytes, save_id, settings_of
from stagerd.daemon.fleet.stake import Stakes, publisher, stake
from stagerd.daemon.fleet.version import same_protocol
from stagerd.engine.adapter import ADAPTER_MAX_SHARD_SIZE
from stagerd.engine.export import mapped_plan
from stagerd.engine.merge import SCRATCH_NAME
from stagerd.engine.plan_types import ExportPlan, OutputFile
from stagerd.errors import ConfigError, SinkError, StagerdError
from stagerd.ops.crashpoints import crash_point
from stagerd.sinks.fetch import RemoteStore, node_part, step_prefix
from stagerd.sinks.fsspec import FsspecSink
from stagerd.sinks.objects import LocalFile
from stagerd.sinks.prune import FLEET_DONE

log = logging.getLogger("stagerd.fleet")

Unit = tuple[Artefact, OutputFile]  # a published file: its artefact and its file in that artefact's plan


@dataclass(frozen=True)
class FleetOptions:
    dtype: str | None = None
    keep_dtype: str | None = None
    mapping: Path | None = None  # for a step whose marker has no to-Hub plan of its own, as export_step
    max_shard_size: int = FLEET_MAX_SHARD_SIZE  # as the daemon's setting with an exchange
    wait_seconds: float = 600.0
    poll_seconds: float = 0.5
    threads: int = 2
    hub: bool = False  # a Hub lane follows: it records the step done (`fleet/hub.py`)
    hubs: tuple[str, ...] = ()  # the Hub sinks' URLs, which every node must name alike
    stopping: Callable[[], bool] | None = None  # the daemon is stopping: a wait ends (`exchange.Stopped`)
    # after each move of a build and each range its mirror fetches: the daemon's yield to a save
    pause: Callable[[], None] | None = None


@dataclass
class FleetResult:
    """What this node did: the files it built, the bytes it read from the exchange and uploaded; and the
    whole export it built with the others, every node's files, as a sink it committed lists them."""

    step: int
    node: int
    nodes: int
    built: list[str]
    bytes_fetched: int = 0
    bytes_uploaded: int = 0  # the sink's files this node sent (its raw part is `bytes_raw`)
    bytes_raw: int = 0
    seconds: float = 0.0
    waited: float = 0.0  # of `seconds`, asleep waiting for other nodes
    committed: bool = False
    failed: dict[str, StagerdError] = field(default_factory=dict)  # sink URL -> what stopped it on this run
    files: list[tuple[str, int]] = field(default_factory=list)  # the export's (name, size), every node's
    tensor_bytes: int = 0
    tensors: int = 0

    @property
    def own_bytes(self) -> int:
        """The size of the export's files this node built: its share of the bytes exported."""
        built = set(self.built)
        return sum(size for rel, size in self.files if rel in built)


class FleetNode:
    """Node `marker.staging_node`'s part of step `marker.step`, resumable from any point."""

    def __init__(
        self,
        step_dir: Path,
        work: Path,
        sinks: Sequence[FsspecSink],
        exchange: FsspecSink,
        store: RemoteStore,
        root_id: str,
        options: FleetOptions = FleetOptions(),
        status: Callable[[str, int], None] | None = None,
        lanes: Sequence[FsspecSink] | None = None,
    ) -> None:
        """`sinks`: every fsspec sink of the fleet (the claim names them all); `lanes`: those this run
        publishes to (a failed sink's lane retrying it: that one), all of them by default."""
        self.step_dir, self.work, self.sinks, self.exchange, self.store = (
            step_dir,
            work,
            sinks,
            exchange,
            store,
        )
        self.root_id, self.opt, self.status = root_id, options, status or (lambda s, n: None)
        self.marker = commit_marker.read_marker(step_dir)
        # which save of this step number: its claim names it
        self.save = commit_marker.marker_identity(step_dir)
        self.step, self.me, self.nodes = self.marker.step, self.marker.staging_node, self.marker.staging_nodes
        o = options  # the step's records on the exchange, and the waits for other nodes:
        self.x = StepExchange(
            exchange,
            store,
            self.step,
            self.me,
            self.nodes,
            o.wait_seconds,
            o.poll_seconds,
            self.status,
            o.stopping,
            save_id(self.marker),
        )
        self.base = self.x.base
        self.lanes = Lanes(self.x, sinks if lanes is None else lanes)
        self.stakes = Stakes(self.x, self.lanes.fail)

    def run(self) -> FleetResult:
        try:
            return self._run()
        except SinkError as e:
            if (named := self.x.failure(e, self.sinks)) is e:
                raise
            raise named from None
        finally:  # the mirror's hard links would keep this node's shards on disk past retention
            shutil.rmtree(self.work, ignore_errors=True)

    def _run(self) -> FleetResult:
        t0 = time.monotonic()
        res = FleetResult(self.step, self.me, self.nodes, [], failed=self.lanes.failed)
        if all(published(s, self.step) for s in self.lanes.all) and self._same_save_on_exchange():
            if self.me == 0:  # a leader killed between the manifest and `latest`, or before `done.json`
                for s in self.lanes.all:
                    s.settle(self.step)
                self._record_done()
            res.files = committed_files(self.lanes.all, self.step)
            return res
        with broken.stopping(self.x, *broken.STEP_FAULTS):
            check_extras(self.step_dir, self.marker)  # as export_step, before anything is written
        claim(self.x, self.root_id, self.save, self._settings())
        # a new try: the others wait for this node's part again
        broken.record(self.x, None)
        for s in self.lanes.all:  # a new try of each: the other nodes wait for it again
            self.x.record_failure(s, None)
        self.x.past_failures(self.lanes.all)
        with self.x.reporting() as progress:  # until this node's part and its files are on the stores
            sending = progress.doing("sending its raw part", "fleet.raw_upload")
            with broken.stopping(self.x, *broken.STEP_FAULTS):
                res.bytes_raw = self.exchange.publish_raw(
                    self.step_dir, self.step, progress=sending
                ).bytes_uploaded
            parts = wait_parts(self.x, self.marker, self.sinks)
            same_protocol(self.x, self.lanes.all)  # before anything is claimed or written on a sink
            wait_agreed(self.x, self._settings())
            # the leader's claim of the export, made before any node writes under a sink's step-N/ (another's
            # step is not ours) and again before each commit
            mine = publisher(self.x, self.step_dir) if self.me == 0 else None
            if mine is not None:
                stake(self.x, mine, self.lanes.live(), self.lanes.fail)
                self.lanes.check()
            # its own shards read again (a link put there since: SymlinkError); the others wait on its files
            with broken.stopping(self.x, *broken.STEP_FAULTS):
                mirror = Mirror(self.work, self.step_dir, parts, self.me, self.x.read, self.opt.pause)
                p, units = self._plan(mirror, mirror.build())
                owner = owners(((rel, f.size) for rel, (_, f) in units.items()), self.nodes)
                planned = {rel: planned_file(art, f) for rel, (art, f) in units.items()}
                res.tensor_bytes, res.tensors = p.total_size, p.tensor_count
                built_here = [(rel, *units[rel]) for rel in units if owner[rel] == self.me]
                self._build(built_here, planned, progress, res)
        res.bytes_fetched = mirror.fetched
        if mine is not None:  # the leader; another plan's file (ConfigError) stops the others too
            with broken.stopping(self.x, ConfigError):
                res.bytes_uploaded += lead(
                    self.x,
                    self.lanes.live(),
                    self.work,
                    self.step_dir,
                    self._target_dtype(),
                    p,
                    parts,
                    owner,
                    planned,
                    self.lanes.fail,
                    mine,
                )
            self.lanes.check()
            res.committed = True
            self._record_done()
        else:
            self.lanes.wait_leader(owner)
        shutil.rmtree(self.work, ignore_errors=True)
        res.files = committed_files(self.lanes.live(), self.step)
        res.seconds, res.waited = time.monotonic() - t0, self.x.waited
        return res

    # -- steps -------------------------------------------------------------------------------------------

    def _build(
        self,
        mine: list[tuple[str, Artefact, OutputFile]],
        planned: dict[str, dict[str, object]],
        progress: Progress,
        res: FleetResult,
    ) -> None:
        """Build each file this node owns that some sink has no record of, send it to those sinks, and
        record it there: never redone once recorded."""
        for rel, art, f in mine:
            todo = [s for s in self.lanes.live() if self.x.record_data(s, rel) is None]
            if not (todo := self.stakes.ready(todo)):  # the fleet's claim of each, seen once
                continue
            out = self.work / "out"
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir()
            building = progress.doing(f"building {rel}", "fleet.build")
            if self.opt.pause is not None:
                building = _then(building, self.opt.pause)
            art.build(f.name, out, threads=self.opt.threads, progress=building)
            n, urls = len(self.sinks), [s.url for s in self.sinks]
            for sink in todo:  # each sink its own work: a second upload of the same bytes is progress too
                to = f" to sink {urls.index(sink.url) + 1} of {n}" if n > 1 else ""
                sent = progress.doing(f"uploading {rel}{to}")
                try:
                    up = self.x.upload(sink, [LocalFile(rel, out / f.name, f.size)], sent)[0]
                except SinkError as e:  # that sink's lane alone: the others go on
                    self.lanes.fail(sink, e)
                    continue
                crash_point("fleet.built")
                self.x.create(self.x.record_key(sink, rel), record_bytes(up, self.me, planned[rel]))
                res.bytes_uploaded += f.size
            res.built.append(rel)
            shutil.rmtree(out, ignore_errors=True)
        self.lanes.check()

    def _same_save_on_exchange(self) -> bool:
        """Whether this node's raw part on the exchange is this save. A step saved again (a run restarted
        from an earlier checkpoint) is not, and must not pass for published: it goes on to its claim
        (`claim.py`), which refuses it by name. A step whose raw part is gone goes on too: it is built
        again, and a sink that holds the same export keeps it."""
        key = f"{step_prefix(self.step, raw=True)}/{node_part(self.me, self.nodes)}/{layout.MARKER_NAME}"
        found = self.store.read(key)
        return found is not None and commit_marker.identity_of(found) == self.save

    def _settings(self) -> dict[str, Any]:
        """What every node's daemon must agree on, named in its claim."""
        mapping = self.opt.mapping if self.marker.hub_plan is None else None
        o = self.opt
        return settings_of(
            self.sinks, self._target_dtype(), o.keep_dtype, o.max_shard_size, mapping, o.hub, o.hubs
        )

    def _record_done(self) -> None:
        """Leader: once every sink holds the step nothing reads the raw parts again, so remote retention may
        take them (with a Hub lane, once every Hub sink's record is there too: `fleet/hub.py`)."""
        if not all(published(s, self.step) for s in self.sinks):
            return  # a failed sink's lane still builds from the raw parts
        if not self.opt.hub or all_hubs_recorded(self.exchange, self.step, self.opt.hubs):
            self.x.create(f"{self.base}/{FLEET_DONE}", b"{}")

    def _plan(self, mirror: Mirror, listed: list[str]) -> tuple[ExportPlan, dict[str, Unit]]:
        """The single-node plan, the to-Hub plan (the marker's, else `--mapping`'s) included, and with a
        PEFT adapter plan the adapter's one file: each published file's name -> its artefact and file."""
        views = self.marker.hub_plan
        if views is None and self.opt.mapping is not None:
            views = mapped_plan(self.marker, self.opt.mapping, self.step_dir)[0]
        ref, merges = self.marker.reference_index, self.work / "merges"
        main = Artefact(
            mirror,
            listed,
            merges / "main" / SCRATCH_NAME,
            views,
            dtype=self._target_dtype(),
            keep_dtype=self.opt.keep_dtype,
            reference=load_weight_map(ref, path=self.step_dir) if isinstance(ref, dict) else None,
            max_shard_size=self.opt.max_shard_size,
            expected=self.marker.tensors,
        )
        units: dict[str, Unit] = {f.name: (main, f) for f in main.files}
        if self.marker.adapter_plan is not None:  # as export._build_adapter: one file, no index
            adapter = Artefact(
                mirror,
                listed,
                merges / "adapter" / SCRATCH_NAME,
                self.marker.adapter_plan,
                dtype=self._target_dtype(),
                keep_dtype=self.opt.keep_dtype,
                reference=None,
                max_shard_size=ADAPTER_MAX_SHARD_SIZE,
                expected=self.marker.tensors,
            )
            (f,) = adapter.files
            units[f"{ADAPTER_DIR}/{ADAPTER_WEIGHTS_NAME}"] = (adapter, f)
        return main.plan, units

    def _target_dtype(self) -> str | None:
        return parse_export_dtype(self.opt.dtype if self.opt.dtype is not None else self.marker.dtype)


def _then(report: Callable[[int, int], None], pause: Callable[[], None]) -> Callable[[int, int], None]:
    def both(done: int, total: int) -> None:
        report(done, total)
        pause()

    return both
