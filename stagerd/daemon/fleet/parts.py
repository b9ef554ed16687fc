"""Every node's raw part of a fleet step on the exchange: the wait until all of them are there (naming the
nodes still missing, and ending at once where waiting cannot help: parts of another node count, a node
that recorded it stopped for good), then each part's commit marker read and checked to be this save's
node k of M, and its files' sizes to be those the marker lists."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from stagerd.contract import commit_marker, layout
from stagerd.contract.json_fields import loads
from stagerd.daemon.fleet import broken
from stagerd.daemon.fleet.exchange import StepExchange
from stagerd.daemon.fleet.plan import NodePart, check_part
from stagerd.daemon.fleet.records import save_of
from stagerd.errors import FleetNodeConflictError, MarkerError, StepConflictError
from stagerd.sinks.fetch import node_part, node_parts, step_prefix
from stagerd.sinks.fsspec import FsspecSink


def wait_parts(
    x: StepExchange, marker: commit_marker.CommitMarker, sinks: Sequence[FsspecSink]
) -> list[NodePart]:
    """Every node's raw part of step `x.step`, once all are on the exchange, each checked to be node k of
    this save; `marker` is this node's, `sinks` every fsspec sink of the fleet (the first names where a node
    that claimed the step elsewhere was met)."""
    raw = step_prefix(x.step, raw=True)

    def seen(listed: Mapping[str, int] | None = None) -> list[str]:
        names = node_parts(x.store.sizes(raw) if listed is None else listed)[0]
        # another count's, or a node index of this count that no node has (a part made by hand)
        want = {node_part(k, x.nodes) for k in range(x.nodes)}
        other = [n for n in names if n not in want]
        if other:  # never one whole set of parts: waiting cannot help
            raise FleetNodeConflictError(
                f"step {x.step}: the exchange holds node parts of another node count or no node "
                f"of this one ({', '.join(other)}) where this node's marker says {x.nodes} nodes",
                path=f"{x.exchange.url}/{raw}",
                hint="every node of a step stages one save with one node count; delete the other "
                f"save's parts from {raw}/ (and its claims from {x.base}/), then retry",
            )
        return names

    def missing() -> str:
        have = seen()
        want = [node_part(k, x.nodes) for k in range(x.nodes)]
        gone = [k for k, n in enumerate(want) if n not in have]
        if (stopped := broken.broken_of(x, gone)) is not None:  # waiting cannot help
            raise stopped
        doing = x.progress_of(gone)  # a raw upload longer than the setting is progress
        for sink in sinks[:1]:  # a node met on the first sink, not this exchange: say so
            doing += x.claimed_elsewhere(sink, gone)
        return f"waiting for node {', '.join(map(str, gone))} (seen: {', '.join(have) or 'none'}{doing})"

    x.wait(lambda: len(seen()) == x.nodes and node_parts(x.store.sizes(raw))[1], missing)
    parts = []
    listed = x.store.sizes(raw)  # once: every part's files, whose sizes `check_part` compares
    for k, name in enumerate(seen(listed)):
        key = f"{raw}/{name}/{layout.MARKER_NAME}"
        try:
            part = loads(x.store.read(key) or b"{}")
        except ValueError as e:  # another node's marker on a shared store: torn or not a marker
            raise MarkerError(f"node part {name}'s commit marker is not JSON: {e}", path=key) from None
        m = commit_marker.CommitMarker.from_json(part, path=key)
        if (m.step, m.staging_node, m.staging_nodes) != (x.step, k, x.nodes):
            raise MarkerError(f"node part {name} holds node {m.staging_node} of {m.staging_nodes}", path=key)
        if save_of(m) != save_of(marker):
            # Every node's marker of one save carries rank 0's `created` and the same global fields:
            # a part of a save made before a restart would be built into this save's export.
            raise StepConflictError(
                f"step {x.step}: node part {name} on the exchange is of another save than this "
                f"node's (saved at {m.created:.3f}, this one at {marker.created:.3f})",
                path=f"{x.exchange.url}/{key}",
                hint=f"every node must stage the same save; to publish this one, remove {raw}/ and "
                f"{x.base}/ from the exchange, then run `stagerd retry ROOT --step {x.step}` on "
                "every node",
            )
        parts.append(NodePart(k, m, f"{raw}/{name}"))
        mine = {rel[len(name) + 1 :]: n for rel, n in listed.items() if rel.startswith(f"{name}/")}
        check_part(parts[-1], mine, x.exchange.url)
    return parts
