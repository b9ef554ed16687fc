"""Which rank writes which tensor, and where each written block sits in its global tensor.

A DTensor's local block is written by its rank, at the global offsets of `__create_chunk_list__` (the
protocol DCP's own planner reads); where the mesh replicates it, only the rank at coordinate 0 of every
replicated mesh dimension writes it, so each block is on disk once. A `Partial` placement (a pending
reduction) is refused. A plain tensor is taken to be replicated on every rank that holds one under its
name, as DCP takes it: the ranks exchange (name, bytes) once per save and each such tensor goes to the
holder with the fewest bytes to write so far, largest first, so a DDP-style state dict is written by
every rank in parallel, not all by rank 0. The assignment depends only on the exchanged lists, so every
rank computes the same one without another message; it is cached while they stay the same.
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
    """What one state dict gives this rank to write before the plain tensors are assigned."""

    blocks: list[Block]  # DTensor blocks this rank writes
    plain: list[Block]  # plain tensors, written by whichever holder the assignment picks

    @property
    def sharded_bytes(self) -> int:
        return sum(b.host.numel() * b.host.element_size() for b in self.blocks)


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


def local_blocks(staged: list[Staged]) -> Local:
    blocks: list[Block] = []
    plain: list[Block] = []
    for s in staged:
        b = _block(s)
        if b is None:
            continue
        (blocks if s.dtensor is not None else plain).append(b)
    return Local(blocks, plain)


def plain_summary(kinds: dict[str, Local]) -> tuple[str, list[tuple[str, int]], int]:
    """(digest, [(kind/name, bytes)], sharded bytes) of this rank's plain tensors, for the exchange."""
    items = sorted(
        (f"{kind}/{b.name}", b.host.numel() * b.host.element_size())
        for kind, local in kinds.items()
        for b in local.plain
    )
    digest = hashlib.sha256(repr(items).encode()).hexdigest()
    return digest, items, sum(local.sharded_bytes for local in kinds.values())


def assign(lists: list[list[tuple[str, int]]], loads: list[int]) -> dict[str, int]:
    """kind/name -> the rank that writes it: the least loaded holder, largest tensors first."""
    holders: dict[str, list[int]] = {}
    size: dict[str, int] = {}
    for rank, items in enumerate(lists):
        for name, nbytes in items:
            holders.setdefault(name, []).append(rank)
            size[name] = max(size.get(name, 0), nbytes)
    load = list(loads)
    out: dict[str, int] = {}
    for name in sorted(size, key=lambda n: (-size[n], n)):
        rank = min(holders[name], key=lambda r: (load[r], r))
        out[name] = rank
        load[rank] += size[name]
    return out


class Assigner:
    """The cached assignment of plain tensors, keyed by every rank's digest."""

    def __init__(self) -> None:
        self._key: tuple[Any, ...] | None = None
        self._owner: dict[str, int] = {}

    def known(self, digests: list[str]) -> bool:
        return self._key == tuple(digests)

    def owner(self) -> dict[str, int]:
        return self._owner

    def learn(self, digests: list[str], lists: list[list[tuple[str, int]]], loads: list[int]) -> None:
        self._key, self._owner = tuple(digests), assign(lists, loads)


def blocks_to_write(kinds: dict[str, Local], owner: dict[str, int], rank: int) -> dict[str, list[Block]]:
    """kind -> the blocks this rank writes: its DTensor blocks and the plain tensors assigned to it."""
    return {
        kind: local.blocks + [b for b in local.plain if owner.get(f"{kind}/{b.name}", 0) == rank]
        for kind, local in kinds.items()
    }
