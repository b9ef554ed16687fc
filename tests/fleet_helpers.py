"""The fleet's nodes in one process (issue 14): each a thread with its own ROOT, sink and exchange clients,
running `FleetNode` as the daemon's export task does."""

from __future__ import annotations

import json
import os
import shutil
import threading
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from stagerd.contract import commit_marker, layout
from stagerd.daemon.fleet.node import FleetNode, FleetOptions, FleetResult
from stagerd.sinks.fetch import RemoteStore
from stagerd.sinks.fsspec import FsspecSink

FAST = {"wait_seconds": 60, "poll_seconds": 0.05}


def fleet_node(
    step_dir: Path, url: str, exchange: str | None = None, root_id: str | None = None, **opts: Any
) -> tuple[FleetNode, list[str]]:
    """Node `step_dir`'s FleetNode publishing to `url` (the exchange too, unless `exchange`), and the list
    its wait reports land in."""
    sink = FsspecSink.from_url(url)
    ex = FsspecSink.from_url(exchange) if exchange else sink
    store = RemoteStore.open(exchange or url)
    work = step_dir.parent / ".stagerd" / "fleet"
    seen: list[str] = []
    node = FleetNode(
        step_dir,
        work,
        [sink],
        ex,
        store,
        root_id or str(step_dir.parent),
        FleetOptions(**{**FAST, **opts}),
        lambda s, n: seen.append(s),
    )
    return node, seen


def run_fleet(node_dirs: list[Path], url: str, **kw: Any) -> list[FleetResult | BaseException]:
    """Every node at once (`run_nodes`), each `fleet_node` publishing to `url`."""
    return run_nodes(lambda k: fleet_node(node_dirs[k], url, **kw)[0], len(node_dirs))


def run_nodes(node: Callable[[int], FleetNode], n: int) -> list[FleetResult | BaseException]:
    """Nodes `node(0)` to `node(n - 1)` at once, each made and run in its own thread, the last started
    first; each one's result or what it raised."""
    out: list[FleetResult | BaseException] = [RuntimeError("not run")] * n

    def one(k: int) -> None:
        try:
            out[k] = node(k).run()
        except BaseException as e:
            out[k] = e

    threads = [threading.Thread(target=one, args=(k,)) for k in reversed(range(n))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return out


def older_node(step_dir: Path, url: str, root_id: str, claim: dict[str, Any]) -> None:
    """What node `step_dir` of another stagerd build writes on the exchange `url` before it looks at any
    other node's writes, byte for byte: its claim (`claim`'s fields added to what every build names), as a
    conditional create, then its raw part. `claim` = the settings alone is a build from before fleet
    protocol versions: its claim is what that build's `fleet/claim.py` wrote."""
    m = commit_marker.read_marker(step_dir)
    save = commit_marker.marker_identity(step_dir)
    mine = {"root": root_id, "node": m.staging_node, "nodes": m.staging_nodes, "save": save, **claim}
    sink = FsspecSink.from_url(url)
    try:
        key = f"fleet/{layout.step_dir_name(m.step)}/node-{m.staging_node:05d}.json"
        assert sink.backend.create(key, json.dumps(mine).encode()), key
        sink.publish_raw(step_dir, m.step)
    finally:
        sink.close()


def split_step(step_dir: Path, dest: Path, nodes: int, *, link: bool = False) -> list[Path]:
    """A step staged to one ROOT, as `nodes` node-local ROOTs under `dest` would hold it: the model shards
    dealt round-robin, every other file on node 0, each marker listing its node's files. `link`: hard links
    instead of copies (a benchmark's GBs; the node dirs must then not be damaged)."""
    marker = commit_marker.read_marker(step_dir)
    shards = sorted(
        (f for f in marker.files if f.path.startswith(layout.MODEL_DIR + "/")), key=lambda f: f.path
    )
    out = []
    for k in range(nodes):
        mine = [f for f in marker.files if f in shards[k::nodes] or (k == 0 and f not in shards)]
        d = dest / f"node{k}" / step_dir.name
        for f in mine:
            (d / f.path).parent.mkdir(parents=True, exist_ok=True)
            (os.link if link else shutil.copyfile)(step_dir / f.path, d / f.path)
        commit_marker.write_marker(d, replace(marker, files=tuple(mine), staging_node=k, staging_nodes=nodes))
        out.append(d)
    return out
