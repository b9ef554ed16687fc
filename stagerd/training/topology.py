"""How the staging root is shared between the ranks: probed once, at construction.

Every node's first rank drops a probe file into `root` and every rank reports which probes it sees
(nodes are told apart by `$STAGERD_NODE_ID`, else the host name).

1. Shared root (every rank sees every probe: one node, or a shared filesystem): global rank 0 writes the
   single marker, listing every rank's files. `staging_node=0`, `staging_nodes=1`.
2. Node-local root (each rank sees exactly its own node's probe): each node's local rank 0 (the lowest
   global rank on that node) writes its node's marker once the whole save has completed on every rank.
   It lists only the files written by that node's ranks, with `staging_node=k`, `staging_nodes=N`
   (nodes numbered by their lowest global rank). `world_size` and `tensors` stay global. Extras and the
   optimizer's DCP `.metadata` are written by global rank 0, so they are on node 0 only. The step is
   whole only once all N node markers exist; one node's shards alone do not tile the model, and the
   export engine refuses them (the marker's global `tensors` reveals the gap).
3. Anything else (some ranks of a node see a different root) is a `ConfigError` at construction.
4. Every rank must call `Stager(...)`, `save()` with the same step (and all or none of them with
   `optimizer_state`), and `close()`. `extras`, `reference_index`, `dtype` and `metadata` are taken from
   rank 0 alone, for every node's marker; other ranks may pass them or not.
"""

from __future__ import annotations

import os
import socket
import uuid
from dataclasses import dataclass
from pathlib import Path

from stagerd.contract import layout
from stagerd.errors import ConfigError
from stagerd.training.collectives import Collectives

PROBE_PREFIX = ".stagerd-probe-"


@dataclass(frozen=True)
class StagingTopology:
    """How the staging root is shared between the ranks (see the module docstring)."""

    shared: bool
    node_of_rank: tuple[int, ...]  # staging node index of every rank (all 0 when shared)
    num_nodes: int  # staging nodes: 1 when shared

    def leader(self, node: int) -> int:
        return self.node_of_rank.index(node)

    def node(self, rank: int) -> int:
        return self.node_of_rank[rank]


def node_id() -> str:
    """What tells this rank's node apart from the others."""
    return os.environ.get("STAGERD_NODE_ID") or socket.gethostname()


def discover(root: Path, comm: Collectives, node_key: str) -> StagingTopology:
    """Probe which ranks see the same `root` (four small collectives, once, at construction)."""
    keys = comm.all_gather(node_key)
    order: list[str] = []
    for k in keys:
        if k not in order:
            order.append(k)
    host_node = tuple(order.index(k) for k in keys)
    me = host_node[comm.rank]
    token = comm.broadcast(uuid.uuid4().hex if comm.rank == 0 else None)
    probe = root / f"{PROBE_PREFIX}{token}-{me}"
    is_leader = host_node.index(me) == comm.rank
    if is_leader:
        layout.write_bytes_atomic(probe, b"")
    comm.all_gather(None)  # every leader's probe exists before anyone looks
    prefix = f"{PROBE_PREFIX}{token}-"
    seen = sorted(int(p.name[len(prefix) :]) for p in root.glob(f"{prefix}*"))
    all_seen = comm.all_gather(seen)  # everyone has looked before a leader removes its probe
    if is_leader:
        probe.unlink()
    everything = list(range(len(order)))
    if all(s == everything for s in all_seen):
        return StagingTopology(True, (0,) * comm.world, 1)
    if all(s == [host_node[r]] for r, s in enumerate(all_seen)):
        return StagingTopology(False, host_node, len(order))
    raise ConfigError(
        f"staging root {root} is shared by some nodes but not others (probes seen per rank: {all_seen})",
        path=root,
        hint="give every node its own local root, or put the root on one filesystem that all ranks share",
    )
