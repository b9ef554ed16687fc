"""The leader's (node 0's) end of a fleet step: the index and extras built once and sent to each sink, then
every file's record awaited and checked against this node's plan, and each sink's commit as soon as its
own records are all there: a sink that fails, here or on a node owning a file it lacks, is left to its
lane and never holds up another's commit. The export's claim naming every node's ROOT
(`claims.fleet_claim`: each node's retention counts the export as its own) was made before any node wrote
under a sink's `step-N/` (`stake.py`); each commit makes it again, where it is gone, or finds it kept."""

from __future__ import annotations

import shutil
from collections.abc import Callable, Sequence
from pathlib import Path

from stagerd.contract import layout
from stagerd.contract.step.held import HeldDir, HeldFiles
from stagerd.daemon.fleet.broken import broken_of
from stagerd.daemon.fleet.exchange import StepExchange
from stagerd.daemon.fleet.plan import NodePart, extras_of
from stagerd.daemon.fleet.records import same_plans, sink_id, uploaded
from stagerd.engine.hub_config import CONFIG_NAME, exported_config
from stagerd.engine.index_json import index_json
from stagerd.engine.plan_types import ExportPlan
from stagerd.errors import RestoreError, SinkConflictError, SinkError, StagerdError
from stagerd.sinks.claims import Claim
from stagerd.sinks.fsspec import FsspecSink
from stagerd.sinks.objects import LocalFile, Uploaded


def lead(
    x: StepExchange,
    sinks: Sequence[FsspecSink],
    work: Path,
    step_dir: Path,
    dtype: str | None,
    p: ExportPlan,
    parts: list[NodePart],
    owner: dict[str, int],
    planned: dict[str, dict[str, object]],
    failed: Callable[[FsspecSink, StagerdError], None],
    mine: Claim,
) -> int:
    """Index and extras on each sink, then each sink committed as soon as every file's record on it is
    there and checked, whatever the other sinks do. `dtype`: the export's; `owner`: every built file's
    owner; `planned`: what this plan says each file is; `failed`: told of each sink dropped from this run
    (its lane tries it again); `mine`: the export's claim (`stake.publisher`), checked again before each
    commit. Returns the bytes sent."""
    names = list(owner)
    out = work / "lead"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    files = []
    if p.has_index:
        (out / layout.INDEX_NAME).write_bytes(index := index_json(p))
        files.append(LocalFile(layout.INDEX_NAME, out / layout.INDEX_NAME, len(index)))
    # this node's extras read from its step held open: a link put in extras/ since the raw part was sent
    # must not have the leader publish what it points at
    with HeldDir.open(step_dir) as step, HeldFiles() as held, held.naming():
        for rel, part in sorted(extras_of(parts).items()):
            if rel == layout.MANIFEST_NAME or not layout.exported_extra(rel):
                # as export_step; as a publish (`scan_dir`): the manifest is the commit's, never an extra
                # uploaded before the files are checked
                continue
            dst = out / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            if part.node == x.me:
                shutil.copyfile(_own_extra(held, step, rel), dst)
            else:
                dst.write_bytes(_their_extra(x, part, rel))
            if rel == CONFIG_NAME:  # as export_step: the config names the dtype the files hold
                config = exported_config(dst, dict(p.dtype_bytes()), dtype, p.named_dtype)
                if config is not None:
                    dst.write_bytes(config)
            files.append(LocalFile(rel, dst, dst.stat().st_size))
    sent = 0
    pending: dict[str, tuple[FsspecSink, list[Uploaded]]] = {}  # sink URL -> the sink, what it was sent
    for sink in sinks:
        try:
            if sink.is_published(x.step):  # a leader killed between two sinks' commits
                sink.settle(x.step)
                continue
            pending[sink.url] = (sink, x.upload(sink, files))
        except SinkError as e:
            failed(sink, e)
            continue
        sent += sum(f.size for f in files)

    def at(sink: FsspecSink) -> str:  # the records, for an error
        return f"{x.exchange.url}/{x.base}/done/{sink_id(sink.url)}/"

    def missing(sink: FsspecSink) -> list[str]:
        got = {n: x.record_data(sink, n) for n in names}
        same_plans(x.step, owner, planned, got, at(sink))
        return [n for n in names if got[n] is None]

    def committed() -> bool:
        """Commit each sink whose files are all recorded; drop one that fails, or that a node owning a file
        it lacks failed (that node's lane, and this one's, try it again)."""
        for url, (sink, digests) in list(pending.items()):
            gone = missing(sink)
            if gone and (stopped := broken_of(x, {owner[n] for n in gone})) is not None:
                raise stopped  # its owner quarantined the step: its files never come
            try:
                why = x.failure_of(sink, {owner[n] for n in gone}) if gone else None
                if why is None and not gone:
                    got = {n: x.record_data(sink, n) for n in names}
                    same_plans(x.step, owner, planned, got, at(sink))
                    x.claim_step(sink, mine)
                    sink.commit_uploaded(
                        x.step, digests + [uploaded(got[n]) for n in names], {"fleet_nodes": x.nodes}
                    )
            except SinkError as e:
                why = e
            if why is not None:
                failed(sink, why)
            if why is not None or not gone:
                del pending[url]
        return not pending

    def waiting() -> str:
        gone = [n for sink, _ in pending.values() for n in missing(sink)]  # progress: its count changes
        nodes = sorted({owner[n] for n in gone})
        of, doing = ", ".join(map(str, nodes)), x.progress_of(nodes)  # a long build is progress too
        recorded = f"{len(names) * len(pending) - len(gone)} of {len(names) * len(pending)} recorded"
        return f"waiting for the files of node {of} ({recorded}{doing})"

    x.wait(committed, waiting)
    return sent


def _own_extra(held: HeldFiles, step: HeldDir, rel: str) -> Path:
    """The proc path of this node's extra `rel`, each directory on the way opened without following a
    link (a link is a `SymlinkError` naming it)."""
    return held.open_at(step, f"{layout.EXTRAS_DIR}/{rel}")


def _their_extra(x: StepExchange, part: NodePart, rel: str) -> bytes:
    """Another node's extra `rel` from its raw part, of the size its marker lists: one gone or of another
    size is a named error, never published as an empty or other file (nor refused for being larger than a
    manifest may be)."""
    path = f"{layout.EXTRAS_DIR}/{rel}"
    key = f"{part.prefix}/{path}"
    size = next(f.size for f in part.marker.files if f.path == path)
    try:
        data, got = x.store.read(key, limit=size), "missing"
    except RestoreError:  # larger than the marker lists
        data, got = None, "larger"
    if data is None or len(data) != size:
        got = got if data is None else f"{len(data)} bytes"
        raise SinkConflictError(
            f"step {x.step}: node {part.node}'s extra {rel} on the exchange is {got}: its marker lists "
            f"{size} bytes",
            path=f"{x.exchange.url}/{key}",
            hint=f"remove {part.prefix}/ from the exchange (node {part.node} sends its part again), then run "
            f"`stagerd retry ROOT --step {x.step}` on every node",
        )
    return data
