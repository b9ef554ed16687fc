"""Collectives on the Stager's own gloo group: gather, sum and broadcast; trivial without a group.

The Stager owns a gloo process group of its own, so its background collectives never interleave with
the training's (and DCP gets the CPU backend it needs).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


class Collectives:
    """The Stager's collectives; `group` None means a single process (every call is local)."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self.rank = dist.get_rank(group) if group is not None else 0
        self.world = dist.get_world_size(group) if group is not None else 1

    def all_gather(self, obj: Any) -> list[Any]:
        if self.group is None:
            return [obj]
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def sum(self, values: list[int]) -> list[int]:
        if self.group is None:
            return list(values)
        t = torch.tensor([int(v) for v in values], dtype=torch.int64)
        dist.all_reduce(t, group=self.group)
        summed: list[int] = t.tolist()
        return summed

    def broadcast(self, obj: Any) -> Any:
        if self.group is None:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, 0), group=self.group)
        return box[0]
