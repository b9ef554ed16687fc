"""The device-to-host copy of a state dict into the Stager's staging buffers.

Staging uses one `DefaultStager` per kind of state (model, optimizer) for the Stager's life. Its
`StateDictStager` caches a host buffer per source storage, so from the second save on nothing is
allocated: the copy goes into the same buffers. Pass state dicts whose tensors alias the live
parameters (`model.state_dict()` under FSDP2 does); a dict of fresh tensors each step defeats the cache.
The stager is handed each DTensor's local tensor, never the DTensor (torch's stager cannot copy a DTensor
whose local tensor starts at a storage offset, and would deep-copy its mesh every save); the DTensors are
rebuilt around the host copies afterwards. Views of one storage (FSDP2's flat buffers, fused QKV splits)
share one host buffer the size of that storage, and a tensor under two keys (tied weights) is copied
once. A non-contiguous tensor is made contiguous after the copy, off the stall (safetensors is
row-major), which allocates per save for that tensor only.

With CUDA the buffers are pinned and the copies non-blocking on a side stream that first waits for the
current stream (construct the Stager after `torch.cuda.set_device`: the side stream lives on the current
device); without CUDA they are plain host memory copied on a background thread.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.tensor import DTensor


def staging_options(*, pin_memory: bool, shared_memory: bool) -> StagingOptions:
    return StagingOptions(
        use_pinned_memory=pin_memory,
        use_shared_memory=shared_memory,
        use_async_staging=True,
        use_non_blocking_copy=torch.cuda.is_available(),
    )


def _locals(obj: Any, wrappers: list[DTensor | None]) -> Any:
    """The state dict with every DTensor replaced by its local tensor; `wrappers` gets, per tensor leaf
    in traversal order, its DTensor or None (containers are rebuilt, so later edits cannot disturb it).

    torch's StateDictStager mistakes a DTensor whose local tensor starts at a non-zero storage offset for
    a tensor with storage of its own (the wrapper reports a non-zero data_ptr) and fails in copy_(); it
    also deep-copies each DTensor's DeviceMesh on every save. Plain local tensors avoid both: views of
    one storage share one staging buffer, a tensor under two keys is staged once.
    """
    if isinstance(obj, torch.Tensor):
        if isinstance(obj, DTensor):
            wrappers.append(obj)
            return obj._local_tensor  # to_local() would add an autograd node per tensor inside the stall
        wrappers.append(None)
        return obj
    if isinstance(obj, Mapping):
        return {k: _locals(v, wrappers) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        out = [_locals(v, wrappers) for v in obj]
        return out if isinstance(obj, list) else tuple(out)
    return obj


def _rewrap(staged: Any, wrappers: Iterator[DTensor | None], memo: dict[tuple[int, int], Any]) -> Any:
    """Put the DTensors back around their staged local tensors (the inverse of `_locals`).

    A non-contiguous staged tensor (a transposed view, say) is made contiguous here, on the committer
    thread, because safetensors stores row-major bytes only; that copy is the one allocation per save
    such a tensor costs, and it stays off the training stall.
    """
    if isinstance(staged, torch.Tensor):
        orig = next(wrappers)
        key = (id(orig), id(staged))
        if key not in memo:  # a tensor under two keys stays one object
            local = staged if staged.is_contiguous() else staged.contiguous()
            # DTensor's own constructor with the original spec (mesh, placements, global shape and
            # stride): 3 us a tensor against 25-65 us for from_local's autograd path, on a thread that
            # DCP's write waits for.
            memo[key] = local if orig is None else DTensor(local, orig._spec, requires_grad=False)
        return memo[key]
    if isinstance(staged, dict):
        return {k: _rewrap(v, wrappers, memo) for k, v in staged.items()}
    if isinstance(staged, list | tuple):
        out = [_rewrap(v, wrappers, memo) for v in staged]
        return out if isinstance(staged, list) else tuple(out)
    return staged


@dataclass
class Staging:
    """One state dict's host copy in flight: the DefaultStager's future and how to re-wrap its result."""

    future: Future[Any]
    wrappers: list[DTensor | None]

    def result(self) -> Any:
        staged = self.future.result()
        with torch.no_grad():
            return _rewrap(staged, iter(self.wrappers), {})


def start_staging(stager: DefaultStager, sd: dict[str, Any]) -> Staging:
    """Start copying `sd` into `stager`'s host buffers (async staging: the result is a Future)."""
    wrappers: list[DTensor | None] = []
    future = stager.stage(_locals(sd, wrappers))
    if not isinstance(future, Future):
        raise TypeError(f"DefaultStager.stage returned {type(future).__name__}, not a Future")
    return Staging(future, wrappers)


def settle(staging: Iterable[Staging]) -> None:
    """Wait for host copies that still read the caller's tensors, whatever their outcome."""
    for st in staging:
        with contextlib.suppress(Exception):
            st.future.result()


def order_after_compute(stagers: Iterable[DefaultStager]) -> None:
    """With CUDA, copies on the staging side stream must start after the compute queued so far."""
    if not torch.cuda.is_available():
        return
    current = torch.accelerator.current_stream()
    for stager in stagers:
        side = getattr(stager, "_staging_stream", None)
        if side is not None:
            side.wait_stream(current)
        else:  # torch changed its internals: fall back to a full wait, correct but slower
            current.synchronize()


def buffer_sizes(stagers: Iterable[DefaultStager]) -> dict[int, int]:
    """data_ptr -> bytes of each cached host staging buffer."""
    out = {}
    for stager in stagers:
        for storage in stager._state_dict_stager._cached_storage_mapping.values():
            out[storage.data_ptr()] = storage.nbytes()
    return out
