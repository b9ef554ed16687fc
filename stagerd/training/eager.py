"""Which tensors of a save are copied before `save()` returns: those that no optimizer step owns.

The host copy runs under the next forward and backward, and the wait before the next optimizer step
(`wait_staged()`) guards only what changes in that step: the parameters and the optimizer's state. A
forward updates buffers in place (BatchNorm's running_mean, running_var and num_batches_tracked; an EMA
kept in forward), BatchNorm's kernel without even bumping their versions, so a copy that reached them
after that forward saved them one forward later than the parameters. `host_copy` snapshots these tensors
on their device at `save()`: with CUDA a copy queued on the current stream, ahead of the next forward's
kernels (nothing waits for it), on the CPU a memcpy; the copy thread then copies the snapshot.

A tensor is matched by its storage (a DTensor's local shard), so a state dict's detached tensors match
the live parameters and buffers they view:
- a buffer of `save(model=...)`: copied at `save()`, whatever its size;
- a parameter of that model (trainable or frozen), or a parameter or state tensor of an attached
  optimizer (`attach()`; its step waits for the copy): copied in the background, as before;
- any other tensor (neither is known, or a state dict's own tensors): copied at `save()` when its storage
  holds at most `EAGER_MAX_BYTES`, above that taken for a parameter (a frozen one no attached optimizer
  names: a PEFT base model's weights) and copied in the background. A buffer that large and updated in
  forward is saved as at `save()` only when `model=` names it.
So a model without buffers, saved with `model=` or an attached optimizer, copies nothing at `save()`, and
the stall is bounded by the buffers' bytes (or the small tensors' where neither is known), never the
parameters'.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from stagerd.training.host_copy import local_tensor
from stagerd.training.optimizer_hook import tensors_in

EAGER_MAX_BYTES = 1 << 18  # any BatchNorm's statistics (65536 fp32 channels); a Llama's norm weights


Key = tuple[int, torch.device]  # a storage's address and device: cheaper than `host_pool.storage_key`


def _keys(tensors: Iterable[Any]) -> set[Key]:
    out = set()
    for t in tensors:
        if isinstance(t, torch.Tensor) and not t.is_meta:
            local = local_tensor(t)
            out.add((local.untyped_storage().data_ptr(), local.device))
    return out


@dataclass(frozen=True)
class Owners:
    """The storages an optimizer step owns (`owned`) and those a forward may update (`buffers`)."""

    owned: frozenset[Key]
    buffers: frozenset[Key]

    @classmethod
    def of(cls, model: Any, optimizers: Iterable[torch.optim.Optimizer]) -> Owners:
        owned: set[Key] = set()
        buffers: set[Key] = set()
        if isinstance(model, torch.nn.Module):
            owned |= _keys(model.parameters())
            buffers |= _keys(model.buffers())
        for opt in optimizers:
            owned |= _keys(p for group in opt.param_groups for p in group["params"])
            owned |= _keys(tensors_in(opt.state.values()))
        return cls(frozenset(owned), frozenset(buffers - owned))

    def eager(self, tensors: Mapping[str, torch.Tensor]) -> set[str]:
        """The names of `tensors` to copy before `save()` returns."""
        out = set()
        for name, t in tensors.items():
            if t.is_meta:
                continue
            local = local_tensor(t)
            storage = local.untyped_storage()
            key, nbytes = (storage.data_ptr(), local.device), storage.nbytes()
            if nbytes and (key in self.buffers or (key not in self.owned and nbytes <= EAGER_MAX_BYTES)):
                out.add(name)
        return out
