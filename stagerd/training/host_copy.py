"""The device-to-host copy of a save's tensors into the Stager's host buffers (`host_pool`).

`save()` only takes the tensors and, with CUDA, records an event on each device's current stream: the
state as the compute queued so far leaves it. Everything else runs on the Stager's copy thread, as one
job for the model and the optimizer state: the buffers missing from each pool are allocated, and each
source storage is copied once into its buffer, `non_blocking` on a side stream that first waits for that
event (a DMA into page-locked memory, beside the next forward and backward), or with a plain copy for
host tensors. The optimizer's copies are queued behind the model's without waiting for them to land, so
the copy engine never idles between the two. Each kind's Future resolves once its bytes have landed;
`wait_staged()` waits for them, and the parameters may change only after that (the optimizer's next
step). How many pieces are in flight follows who waits (`Pace`). The tensors a forward may update in
place (`eager`: buffers such as BatchNorm's running statistics) are snapshotted on their device first,
before `save()` returns and (with CUDA) ahead of the next forward on the current stream; their buffers
are filled from that snapshot.

The tensors are the local tensors of DTensors (their `_local_tensor`, without `to_local()`'s autograd
node): views of one storage share one buffer, a tensor under two keys (tied weights) is copied once, and
each staged tensor is a view of its buffer with the source's offset, shape and stride. Pass state dicts
whose tensors are the live parameters and optimizer states (`model.state_dict()`, `optimizer.state_dict()`
and FSDP2's `get_state_dict` are): then every save copies into the same buffers and nothing is allocated.
The source tensors are held until the copy is done, so their memory cannot be reused under it.
"""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from queue import SimpleQueue
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


Leaves = list[tuple[str, torch.Tensor, DTensor | None]]  # (name, local tensor, its DTensor) of each leaf


COPY_CHUNK_BYTES = 32 << 20  # 0.6 ms at 55 GB/s: the most a copy the loop queues waits for this one
COPY_WINDOW = 1  # pieces in flight once `save()` has returned (`_Sender`)
COPY_LEAD = 8  # pieces in flight while `save()` still runs, where the device had nothing queued before it
_ALL = 1 << 62  # every piece at once: the caller waits for the copy


class Pace:
    """How many pieces of one save's copy may be in flight (`_Sender`).

    While `save()` still runs Python after starting the copy, the copy thread waits for the GIL after
    each piece, up to the interpreter's switch interval (5 ms), so one piece in flight leaves the copy
    engine idle: `COPY_LEAD` pieces are queued ahead then, unless the device still had work queued at
    `save()` (the loop's step: its next `.item()` would wait behind them). Once `save()` returns,
    `COPY_WINDOW` (`steady`). Once anyone waits for the copy (`wait_staged()`, the optimizer's hook, a
    refused save settling), nothing of the loop's can need the copy engine before it ends: the rest is
    queued at once (`hurry`), at the queued-whole rate."""

    def __init__(self) -> None:
        self._window = COPY_LEAD
        self._lock = threading.Lock()

    @property
    def window(self) -> int:
        return self._window

    def steady(self) -> None:
        with self._lock:
            if self._window != _ALL:
                self._window = COPY_WINDOW

    def hurry(self) -> None:
        with self._lock:
            self._window = _ALL


@dataclass
class _Part:
    """One kind's share of a save's copy, as `save()` hands it to the copy thread."""

    kind: str
    leaves: Leaves
    ready: dict[torch.device, torch.cuda.Event]  # the compute stream's state at save(), per device
    snaps: dict[StorageKey, torch.Tensor]  # the snapshots of the storages copied at save() (`eager`)
    future: Future[list[Staged]]


def _part(kind: str, tensors: Mapping[str, torch.Tensor], eager: Iterable[str]) -> _Part:
    """Take `tensors` (name -> tensor or DTensor) for the copy thread; those named in `eager` are
    snapshotted now."""
    leaves = [(name, local_tensor(t), t if isinstance(t, DTensor) else None) for name, t in tensors.items()]
    names = set(eager)
    snaps = _snapshot(local for name, local, _ in leaves if name in names)
    ready: dict[torch.device, torch.cuda.Event] = {}
    for _, local, _ in leaves:
        if local.is_cuda and local.device not in ready:
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(local.device))
            ready[local.device] = ev
    return _Part(kind, leaves, ready, snaps, Future())


class Copy:
    """One save's host copies in flight: a `Staging` per kind, and their shared `Pace`. More kinds may
    follow the first (`add`) until `close()`; the copy thread waits for them, so whoever starts a copy
    with `more` must close it."""

    def __init__(self, pace: Pace) -> None:
        self.staging: dict[str, Staging] = {}
        self.pace = pace
        self._parts: SimpleQueue[_Part | None] = SimpleQueue()

    def add(self, kind: str, tensors: Mapping[str, torch.Tensor], eager: Iterable[str] = ()) -> None:
        """Copy `tensors` into the pool of `kind` too, after what was added before."""
        part = _part(kind, tensors, eager)
        self.staging[kind] = Staging(part.future)
        self._parts.put(part)

    def close(self) -> None:
        self._parts.put(None)


class HostCopier:
    """Copies a save's state dicts into their `HostPool`s on the Stager's copy thread, as one job."""

    def __init__(self, pools: Mapping[str, HostPool], executor: ThreadPoolExecutor) -> None:
        self.pools = pools
        self._executor = executor
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def start(
        self, parts: Mapping[str, tuple[Mapping[str, torch.Tensor], Iterable[str]]], *, more: bool = False
    ) -> Copy:
        """Start copying each kind's tensors (kind -> (name -> tensor or DTensor, the names to snapshot
        now)) into the pool of that kind, in order; returns once the `eager` ones are snapshotted, the
        rest is copied later. One job for all: the copy engine goes on from one kind to the next without
        waiting for the first to land. `more`: kinds may follow (`Copy.add`) until `Copy.close()`."""
        copy = Copy(Pace())
        for kind, (tensors, eager) in parts.items():
            copy.add(kind, tensors, eager)
        if not more:
            copy.close()
        self._executor.submit(self._copy, copy._parts, copy.pace)
        return copy

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device=device)
        return self._streams[device]

    def _copy(self, parts: SimpleQueue[_Part | None], pace: Pace) -> None:
        sender = _Sender(self._stream, pace)
        first, closed = True, False
        futures: list[Future[list[Staged]]] = []
        try:
            with torch.no_grad():
                while True:
                    part = parts.get()
                    if part is None:
                        closed = True
                        break
                    futures.append(part.future)
                    part.future.set_running_or_notify_cancel()
                    if first and part.ready and not all(ev.query() for ev in part.ready.values()):
                        pace.steady()  # the loop's step is still queued: no piece ahead of its `.item()`
                    first = False
                    self._send(sender, part)
                    # the part is let go here, its sources held until they land (`_send`): a waiter
                    # finds nothing of the caller's state held
                    del part
                sender.finish()
        except BaseException as e:
            sender.drain()  # copies queued before the failure still read the sources held here
            for f in futures:
                if not f.done():
                    f.set_exception(e)
            while not closed:  # kinds added after the failure fail with it
                later = parts.get()
                if later is None:
                    break
                later.future.set_exception(e)

    def _send(self, sender: _Sender, part: _Part) -> None:
        """Queue one kind's copies on `sender`; its Future gets the staged views once they have landed.
        The views are made after the copies are queued, while they run."""
        pool, leaves, snaps, future = self.pools[part.kind], part.leaves, part.snaps, part.future
        part.leaves, part.snaps = [], {}
        pool.wait_reserved()
        copies: dict[StorageKey, tuple[torch.Tensor, torch.Tensor]] = {}  # key -> (buffer, its bytes)
        bufs: list[torch.Tensor | None] = []  # each leaf's buffer, None for an empty tensor
        for _, local, _ in leaves:
            key = storage_key(local)
            if key[2] == 0:
                bufs.append(None)
                continue
            buf = pool.get(key)
            bufs.append(buf)
            if key not in copies:
                copies[key] = (buf, snaps[key] if key in snaps else _bytes_of(local))
        used = set(copies)
        held = list(copies.values())  # the sources stay referenced until their copy has landed
        del copies, snaps
        devices = sender.issue(held, part.ready)
        staged: list[Staged] = []
        for (name, local, dt), into in zip(leaves, bufs, strict=True):
            if into is None:  # nothing to copy (an empty tensor): a host tensor of its shape
                host = torch.empty(local.shape, dtype=local.dtype)
            else:
                host = torch.empty(0, dtype=local.dtype).set_(
                    into.untyped_storage(), local.storage_offset(), local.shape, local.stride()
                )
            staged.append(Staged(name, host, dt))
        del leaves, bufs

        def landed() -> None:
            held.clear()
            pool.keep_only(used)
            future.set_result(staged)

        sender.mark(devices, landed)


class _Sender:
    """Queues a job's copies: host tensors at once, device tensors on their device's side stream (after
    the compute stream's state at `save()`), in `COPY_CHUNK_BYTES` pieces, each issued once fewer than
    `pace.window` are in flight; calls each kind's `landed` once its copies have.

    The copy engine keeps serving a stream that always has a copy queued: a device-to-host copy the loop
    queues on its own stream meanwhile (`loss.item()` right after the step) waited for the whole save's
    copy, 29 ms for 2 GB on an H200 whether 4 pieces or all of them were queued ahead. With one piece in
    flight the engine is free for a moment between pieces and that copy goes first: it waited no longer
    than without a save, and the save's copy ran at 99% of its queued-whole rate with the loop waiting,
    92% with it launching kernels (`bench/bench_copy_pacing.py`)."""

    def __init__(self, stream: Callable[[torch.device], torch.cuda.Stream], pace: Pace) -> None:
        self._stream = stream
        self._pace = pace
        self._pending: deque[torch.cuda.Event] = deque()
        self._queued = 0
        self._marks: deque[tuple[list[torch.cuda.Event], Callable[[], None]]] = deque()

    def issue(
        self, pairs: list[tuple[torch.Tensor, torch.Tensor]], ready: dict[torch.device, torch.cuda.Event]
    ) -> list[torch.device]:
        """Queue the copies of `pairs` (buffer, source), each device's after its `ready` event; the
        devices they were queued on (host ones are done when this returns)."""
        devices: list[torch.device] = []
        for buf, src in pairs:
            if src.device.type != "cuda":
                buf.copy_(src)
                continue
            if src.device not in devices:
                devices.append(src.device)
                self._stream(src.device).wait_event(ready[src.device])
            self._device_copy(buf, src)
        return devices

    def mark(self, devices: list[torch.device], landed: Callable[[], None]) -> None:
        """Call `landed` once everything queued so far on `devices` has landed (now, for none)."""
        if not devices:
            landed()
            return
        self._marks.append(([_recorded(self._stream(d)) for d in devices], landed))

    def _device_copy(self, buf: torch.Tensor, src: torch.Tensor) -> None:
        side = self._stream(src.device)
        n = src.numel()
        with torch.cuda.stream(side):
            for at in range(0, n, COPY_CHUNK_BYTES):
                end = min(n, at + COPY_CHUNK_BYTES)
                buf[at:end].copy_(src[at:end], non_blocking=True)
                self._queued += end - at
                if self._queued >= COPY_CHUNK_BYTES:
                    self._queued = 0
                    self._pending.append(_recorded(side))
                    while len(self._pending) >= self._pace.window:
                        _wait(self._pending.popleft())
                        self._fire()

    def _fire(self) -> None:
        """Call `landed` of the kinds whose copies are all done, in order."""
        while self._marks and all(ev.query() for ev in self._marks[0][0]):
            self._marks.popleft()[1]()

    def finish(self) -> None:
        """Wait for every copy queued; each kind's `landed` in order."""
        while self._marks:
            events, landed = self._marks.popleft()
            for ev in events:
                _wait(ev)
            landed()
        self._pending.clear()

    def drain(self) -> None:
        """After a failure: wait for whatever was queued, as far as the device lets us."""
        for events in [list(self._pending), *(evs for evs, _ in self._marks)]:
            for ev in events:
                with contextlib.suppress(Exception):
                    _wait(ev)
        self._pending.clear()
        self._marks.clear()


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
