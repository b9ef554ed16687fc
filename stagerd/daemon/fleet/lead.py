"""The leader's (node 0's) end of a fleet step: the index and extras built once, then on each sink in
turn every file's record awaited and checked against this node's plan, and the commit."""

from __future__ import annotations

import shutil
from collections.abc import Callable, Sequence
from pathlib import Path

from stagerd.contract import layout
from stagerd.contract.step.held import HeldDir, HeldFiles
from stagerd.daemon.fleet.exchange import StepExchange
from stagerd.daemon.fleet.plan import NodePart, extras_of
from stagerd.daemon.fleet.records import same_plans, sink_id, uploaded
from stagerd.engine.hub_config import CONFIG_NAME, exported_config
from stagerd.engine.index_json import index_json
from stagerd.engine.plan_types import ExportPlan
from stagerd.sinks.fsspec import FsspecSink
from stagerd.sinks.objects import LocalFile


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
) -> int:
    """Index and extras, then every file's record checked, then the commit: on each sink in turn.
    `dtype`: the export's; `owner`: every built file's owner; `planned`: what this plan says each file is.
    Returns the bytes sent."""
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
            if rel == layout.INDEX_NAME or rel.endswith(".safetensors"):
                continue  # as export_step: our index and weights are the export's
            dst = out / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            if part.node == x.me:
                shutil.copyfile(_own_extra(held, step, rel), dst)
            else:
                dst.write_bytes(x.store.read(f"{part.prefix}/{layout.EXTRAS_DIR}/{rel}") or b"")
            if rel == CONFIG_NAME:  # as export_step: the config names the dtype the files hold
                config = exported_config(dst, dict(p.dtype_bytes()), dtype)
                if config is not None:
                    dst.write_bytes(config)
            files.append(LocalFile(rel, dst, dst.stat().st_size))
    sent = 0
    for sink in sinks:
        if sink.is_published(x.step):  # a leader killed between two sinks' commits
            sink.move_latest(x.step)
            continue
        digests = x.upload(sink, files)
        sent += sum(f.size for f in files)

        at = f"{x.exchange.url}/{x.base}/done/{sink_id(sink.url)}/"  # the records, for an error

        def missing(sink: FsspecSink = sink, at: str = at) -> list[str]:
            got = {n: x.record_data(sink, n) for n in names}
            same_plans(x.step, owner, planned, got, at)
            return [n for n in names if got[n] is None]

        def waiting(missing: Callable[[], list[str]] = missing) -> str:
            gone = missing()  # its count changes with each record: progress for the wait's deadline
            nodes = sorted({owner[n] for n in gone})
            of, doing = ", ".join(map(str, nodes)), x.progress_of(nodes)  # a long build is progress too
            recorded = f"{len(names) - len(gone)} of {len(names)} recorded"
            return f"waiting for the files of node {of} ({recorded}{doing})"

        x.wait(lambda: not missing(), waiting)
        got = {n: x.record_data(sink, n) for n in names}
        same_plans(x.step, owner, planned, got, at)
        digests += [uploaded(got[n]) for n in names]
        sink.commit_uploaded(x.step, digests, {"fleet_nodes": x.nodes})
    return sent


def _own_extra(held: HeldFiles, step: HeldDir, rel: str) -> Path:
    """The proc path of this node's extra `rel`, each directory on the way opened without following a
    link (a link is a `SymlinkError` naming it)."""
    return held.open_at(step, f"{layout.EXTRAS_DIR}/{rel}")
