"""The device-to-host copy of a save's tensors into the Stager's host buffers (`host_pool`).

`save()` only takes the tensors and, with CUDA, records an event on each device's current stream: the
state as the compute queued so far leaves it. Everything else runs on the Stager's copy thread: the
buffers missing from the pool are allocated, and each source storage is copied once into its buffer,
`non_blocking` on a side stream that first waits for that event (a DMA into page-locked memory, beside
the next forward and backward), or with a plain copy for host tensors. The copy's Future resolves once
every byte has landed; `wait_staged()` waits for it, and the parameters may change only after that
(the optimizer's next step). The tensors a forward may update in place (`eager`: buffers such as
BatchNorm's running statistics) are snapshotted on their device first, before `save()` returns and (with
CUDA) ahead of the next forward on the current stream; their buffers are filled from that snapshot.

The tensors are the local tensors of DTensors (their `_local_tensor`, without `to_local()`'s autograd
node): views of one storage share one buffer, a tensor under two keys (tied weights) is copied once, and
each staged tensor is a view of its buffer with the source's offset, shape and stride. Pass state dicts
whose tensors are the live parameters and optimizer states (`model.state_dict()`, `optimizer.state_dict()`
and FSDP2's `get_state_dict` are): then every save copies into the same buffers and nothing is allocated.
The source tensors are held until the copy is done, so their memory cannot be reused under it.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from stagerd.training.host_pool import HostPool, StorageKey, storage_key


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard as the plain tensor it holds (to_local() would add an autograd node)."""
    if isinstance(t, DTensor):
        local = getattr(t, "_local_tensor", None)
        return local if isinstance(local, torch.Tensor) else t.to_local()
    return t


@dataclass(frozen=True)
class Staged:
    """One tensor leaf's host copy: a view of its buffer shaped like the local source tensor."""

    name: str
    host: torch.Tensor
    dtensor: DTensor | None  # the source's DTensor (its placement), None for a plain tensor


@dataclass
class Staging:
    """One state dict's host copy in flight."""

    future: Future[list[Staged]]

    def result(self) -> list[Staged]:
        return self.future.result()


Job = tuple[
    list[tuple[str, torch.Tensor, DTensor | None]],  # (name, local tensor, its DTensor) of each leaf
    dict[torch.device, torch.cuda.Event],  # the compute stream's state at save(), per device
    dict[StorageKey, torch.Tensor],  # the snapshots of the storages copied at save() (`eager`)
]


COPY_CHUNK_BYTES = 32 << 20  # 0.6 ms at 55 GB/s: the most a copy the loop queues waits for this one
COPY_WINDOW = 1  # pieces in flight (`_paced`)


class HostCopier:
    """Copies state dicts into one `HostPool` on the Stager's copy thread."""

    def __init__(self, pool: HostPool, executor: ThreadPoolExecutor) -> None:
        self.pool = pool
        self._executor = executor
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def start(self, tensors: dict[str, torch.Tensor], eager: Iterable[str] = ()) -> Staging:
        """Start copying `tensors` (name -> tensor or DTensor); returns once those named in `eager` are
        snapshotted (`eager`), the rest is copied later."""
        leaves = [
            (name, local_tensor(t), t if isinstance(t, DTensor) else None) for name, t in tensors.items()
        ]
        wanted = set(eager)
        snaps = _snapshot(local for name, local, _ in leaves if name in wanted)
        ready: dict[torch.device, torch.cuda.Event] = {}
        for _, local, _ in leaves:
            if local.is_cuda and local.device not in ready:
                ev = torch.cuda.Event()
                ev.record(torch.cuda.current_stream(local.device))
                ready[local.device] = ev
        return Staging(self._executor.submit(self._copy, [(leaves, ready, snaps)]))

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device=device)
        return self._streams[device]

    def _copy(self, job: list[Job]) -> list[Staged]:
        # The executor's work item keeps its arguments until after the Future resolves: taken out of
        # it, the sources are let go before, and a waiter finds nothing of the caller's state held.
        leaves, ready, snaps = job.pop()
        with torch.no_grad():
            return self._copy_all(leaves, ready, snaps)

    def _copy_all(
        self,
        leaves: list[tuple[str, torch.Tensor, DTensor | None]],
        ready: dict[torch.device, torch.cuda.Event],
        snaps: dict[StorageKey, torch.Tensor],
    ) -> list[Staged]:
        self.pool.wait_reserved()
        staged: list[Staged] = []
        copies: dict[StorageKey, tuple[torch.Tensor, torch.Tensor]] = {}  # key -> (buffer, its bytes)
        for name, local, dt in leaves:
            key = storage_key(local)
            if key[2] == 0:  # nothing to copy (an empty tensor): a host tensor of its shape
                staged.append(Staged(name, torch.empty(local.shape, dtype=local.dtype), dt))
                continue
            buf = self.pool.get(key)
            if key not in copies:
                copies[key] = (buf, snaps[key] if key in snaps else _bytes_of(local))
            host = torch.empty(0, dtype=local.dtype).set_(
                buf.untyped_storage(), local.storage_offset(), local.shape, local.stride()
            )
            staged.append(Staged(name, host, dt))
        done: list[torch.cuda.Event] = []
        by_device: dict[torch.device, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for buf, src in copies.values():
            by_device.setdefault(src.device, []).append((buf, src))
        for device, pairs in by_device.items():
            if device.type == "cuda":
                side = self._stream(device)
                side.wait_event(ready[device])
                done.append(_paced(side, pairs))
            else:
                for buf, src in pairs:
                    buf.copy_(src)
        for ev in done:
            _wait(ev)
        self.pool.keep_only(set(copies))
        return staged


def _paced(side: torch.cuda.Stream, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.cuda.Event:
    """Queue the copies of `pairs` on `side` in `COPY_CHUNK_BYTES` pieces, each issued once fewer than
    `COPY_WINDOW` are in flight; the event of the last piece.

    The copy engine keeps serving a stream that always has a copy queued: a device-to-host copy the loop
    queues on its own stream meanwhile (`loss.item()` right after the step) waited for the whole save's
    copy, 29 ms for 2 GB on an H200 whether 4 pieces or all of them were queued ahead. With one piece in
    flight the engine is free for a moment between pieces and that copy goes first: it waited no longer
    than without a save, and the save's copy ran at 99% of its queued-whole rate with the loop waiting,
    92% with it launching kernels (`bench/bench_copy_pacing.py`)."""
    pending: deque[torch.cuda.Event] = deque()
    queued = 0
    with torch.cuda.stream(side):
        for buf, src in pairs:
            n = src.numel()
            for at in range(0, n, COPY_CHUNK_BYTES):
                end = min(n, at + COPY_CHUNK_BYTES)
                buf[at:end].copy_(src[at:end], non_blocking=True)
                queued += end - at
                if queued >= COPY_CHUNK_BYTES:
                    queued = 0
                    pending.append(_recorded(side))
                    if len(pending) >= COPY_WINDOW:
                        _wait(pending.popleft())
        return _recorded(side)


def _recorded(stream: torch.cuda.Stream) -> torch.cuda.Event:
    ev = torch.cuda.Event()
    ev.record(stream)
    return ev


def _wait(ev: torch.cuda.Event) -> None:
    ev.synchronize()


def _snapshot(tensors: Iterable[torch.Tensor]) -> dict[StorageKey, torch.Tensor]:
    """A copy of each storage under `tensors`, made now: one concatenation per device, queued on its
    current stream with CUDA (ahead of whatever the caller queues next), so later in-place updates of
    the sources do not reach it (`eager`)."""
    by_device: dict[torch.device, dict[StorageKey, torch.Tensor]] = {}
    for t in tensors:
        key = storage_key(t)
        if key[2]:
            by_device.setdefault(t.device, {}).setdefault(key, _bytes_of(t))
    out: dict[StorageKey, torch.Tensor] = {}
    for device, flats in by_device.items():
        with (
            torch.no_grad(),
            torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext(),
        ):
            whole = torch.cat(list(flats.values()))
        out.update(zip(flats, whole.split([f.numel() for f in flats.values()]), strict=True))
    return out


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """The whole storage under `t` as a flat uint8 tensor on its device."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


def reserve_keys(tensors: Any) -> list[StorageKey]:
    """The storage keys of every tensor under `tensors` (an iterable of tensors or DTensors)."""
    return [storage_key(local_tensor(t)) for t in tensors]


def completion(future: Future[Any]) -> Future[None]:
    """A Future that ends as `future` does, without its result: a save's handle lives until `wait()`,
    and the staged views would keep host buffers alive that the pool has freed since."""
    out: Future[None] = Future()

    def relay(done: Future[Any]) -> None:
        error = done.exception()
        if error is None:
            out.set_result(None)
        else:
            out.set_exception(error)

    future.add_done_callback(relay)
    return out


def settle(staging: Iterable[Staging]) -> None:
    """Wait for host copies that still read the caller's tensors, whatever their outcome."""
    for st in staging:
        with contextlib.suppress(Exception):
            st.future.result()
