"""Which rank writes which tensor, and where each written block sits in its global tensor.

A DTensor's local block is written at the global offsets of `__create_chunk_list__` (the protocol DCP's
own planner reads); where its mesh replicates it, only the rank at coordinate 0 of every replicated mesh
dimension holds it. A `Partial` placement (a pending reduction) is refused. A DTensor on a mesh of fewer
ranks than the world (FSDP's data-parallel sub-mesh of a 2D mesh, beside tensor parallelism) may have
the same block on every other such sub-mesh, which its own placements do not say: those blocks are pooled,
as DCP's `dedup_save_plans` dedups by (name, offsets). So is a plain tensor, taken to be replicated on
every rank that holds one under its name, as DCP takes it. The ranks exchange the pooled (name, offsets,
bytes) once per save and each pooled block goes to the holder with the fewest bytes to write so far,
largest first, so each block is on disk once and a DDP-style state dict is written by every rank in
parallel, not all by rank 0. The assignment depends only on the exchanged lists, so every rank computes
the same one without another message; it is cached while they stay the same.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor.placement_types import Partial, Replicate

from stagerd.errors import SaveInputError
from stagerd.training.host_copy import Staged


@dataclass(frozen=True)
class Block:
    """One block this rank writes: the name, its host bytes and where it sits in its global tensor."""

    name: str
    host: torch.Tensor
    offsets: tuple[int, ...]
    global_shape: tuple[int, ...]


@dataclass(frozen=True)
class Local:
    """What one state dict gives this rank to write before the pooled blocks are assigned."""

    blocks: list[Block]  # DTensor blocks this rank writes
    pooled: list[Block]  # plain tensors and sub-mesh blocks, written by whichever holder `assign` picks

    @property
    def sharded_bytes(self) -> int:
        return sum(b.host.numel() * b.host.element_size() for b in self.blocks)


Key = tuple[str, str, tuple[int, ...]]  # (kind, name, offsets) of a pooled block


def _block(s: Staged) -> Block | None:
    """The block of one staged leaf, or None when another rank writes the same replica."""
    dt = s.dtensor
    if dt is None:
        shape = tuple(s.host.shape)
        return Block(s.name, s.host, (0,) * len(shape), shape)
    placements = dt.placements
    if any(isinstance(p, Partial) for p in placements):
        raise SaveInputError(f"{s.name!r} is a DTensor with a Partial placement: reduce it before saving")
    coord = dt.device_mesh.get_coordinate()
    if coord is None:  # this rank is not in the tensor's mesh
        return None
    if any(isinstance(p, Replicate) and c != 0 for p, c in zip(placements, coord, strict=True)):
        return None
    chunks = dt.__create_chunk_list__()
    if len(chunks) != 1:
        raise SaveInputError(f"{s.name!r}: a DTensor with {len(chunks)} local chunks cannot be saved")
    offsets = tuple(int(x) for x in chunks[0].offsets)
    return Block(s.name, s.host, offsets, tuple(int(x) for x in dt.shape))


def local_blocks(staged: list[Staged], world: int) -> Local:
    blocks: list[Block] = []
    pooled: list[Block] = []
    for s in staged:
        b = _block(s)
        if b is None:
            continue
        whole_world = s.dtensor is not None and s.dtensor.device_mesh.size() >= world
        (blocks if whole_world else pooled).append(b)
    return Local(blocks, pooled)


def _key(kind: str, b: Block) -> Key:
    return (kind, b.name, b.offsets)


def pooled_summary(kinds: dict[str, Local]) -> tuple[str, list[tuple[Key, int]], int]:
    """(digest, [((kind, name, offsets), bytes)], sharded bytes) of this rank's pooled blocks, for the
    exchange."""
    items = sorted(
        (_key(kind, b), b.host.numel() * b.host.element_size())
        for kind, local in kinds.items()
        for b in local.pooled
    )
    digest = hashlib.sha256(repr(items).encode()).hexdigest()
    return digest, items, sum(local.sharded_bytes for local in kinds.values())


def assign(lists: list[list[tuple[Key, int]]], loads: list[int]) -> dict[Key, int]:
    """(kind, name, offsets) -> the rank that writes it: the least loaded holder, largest blocks first."""
    holders: dict[Key, list[int]] = {}
    size: dict[Key, int] = {}
    for rank, items in enumerate(lists):
        for name, nbytes in items:
            holders.setdefault(name, []).append(rank)
            size[name] = max(size.get(name, 0), nbytes)
    load = list(loads)
    out: dict[Key, int] = {}
    for name in sorted(size, key=lambda n: (-size[n], n)):
        rank = min(holders[name], key=lambda r: (load[r], r))
        out[name] = rank
        load[rank] += size[name]
    return out


class Assigner:
    """The cached assignment of pooled blocks, keyed by every rank's digest."""

    def __init__(self) -> None:
        self._key: tuple[Any, ...] | None = None
        self._owner: dict[Key, int] = {}

    def known(self, digests: list[str]) -> bool:
        return self._key == tuple(digests)

    def owner(self) -> dict[Key, int]:
        return self._owner

    def learn(self, digests: list[str], lists: list[list[tuple[Key, int]]], loads: list[int]) -> None:
        self._key, self._owner = tuple(digests), assign(lists, loads)


def blocks_to_write(kinds: dict[str, Local], owner: dict[Key, int], rank: int) -> dict[str, list[Block]]:
    """kind -> the blocks this rank writes: its own DTensor blocks and the pooled blocks assigned to it."""
    return {
        kind: local.blocks + [b for b in local.pooled if owner.get(_key(kind, b), 0) == rank]
        for kind, local in kinds.items()
    }
