"""The Stager's own host staging buffers: one byte buffer per source storage, kept for the Stager's life.

Each buffer is plain host memory from torch's CPU allocator; with CUDA it is then page-locked in place
with `cudaHostRegister` (what `torch.cuda.cudart()` exposes, the same call DCP's stager makes), so a
`non_blocking` device-to-host copy into it is a true DMA on a side stream. Registering in place, rather
than `torch.empty(pin_memory=True)`, keeps the buffer its exact size: torch's caching host allocator
rounds every pinned block up to a power of two (a 1.1 GB embedding would pin 2 GiB).

Buffers are keyed by their source storage (device, address, size), so views of one storage share one
buffer and a save of the same tensors copies into the same memory as the save before. `reserve` makes
them ahead of the first save, on a background thread (page-locking 5 GB takes seconds); a buffer that a
save no longer uses is freed after that save.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

log = logging.getLogger("stagerd.stage")

StorageKey = tuple[str, int, int]  # (device, data_ptr, nbytes) of a source storage


def storage_key(t: torch.Tensor) -> StorageKey:
    s = t.untyped_storage()
    return (str(t.device), s.data_ptr(), s.nbytes())


def _register(buf: torch.Tensor) -> None:
    """Page-lock `buf` in place (cudaHostRegisterPortable), so copies into it are asynchronous."""
    rc = int(torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), buf.numel(), 1))
    if rc != 0:
        raise RuntimeError(f"cudaHostRegister of {buf.numel()} bytes failed with CUDA error {rc}")


def _unregister(buf: torch.Tensor) -> None:
    rc = int(torch.cuda.cudart().cudaHostUnregister(buf.data_ptr()))
    if rc != 0:
        log.warning("cudaHostUnregister failed with CUDA error %d", rc)


class HostPool:
    """Host byte buffers for one kind of state (model or optimizer), keyed by source storage."""

    def __init__(self, *, pin: bool, name: str) -> None:
        self.pin = pin and torch.cuda.is_available()
        self._buffers: dict[StorageKey, torch.Tensor] = {}
        self._lock = threading.Lock()
        self._reserving: list[Future[None]] = []
        self._executor: ThreadPoolExecutor | None = None
        self._name = name
        self._released = 0  # how many times `release` ran: a reservation older than that keeps nothing

    def _allocate(self, nbytes: int) -> torch.Tensor:
        buf = torch.empty(nbytes, dtype=torch.uint8)
        if self.pin:
            _register(buf)  # faults every page in as it locks it
        else:
            buf.fill_(0)  # fault the pages in now, not inside the first copy
        return buf

    def get(self, key: StorageKey) -> torch.Tensor:
        """The buffer of the storage `key`, allocated now if it is not there yet."""
        buf = self._buffers.get(key)
        if buf is None:
            new = self._allocate(key[2])
            with self._lock:
                buf = self._buffers.setdefault(key, new)
            if buf is not new:  # a reservation made it meanwhile
                self._free([new])
        return buf

    def reserve(self, keys: Iterable[StorageKey]) -> Future[None]:
        """Allocate the buffers of `keys` that are missing, on a background thread; its Future."""
        missing = [k for k in dict.fromkeys(keys) if k not in self._buffers and k[2] > 0]
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix=f"stagerd-reserve-{self._name}")
        fut = self._executor.submit(self._reserve, missing, self._released)
        with self._lock:
            self._reserving.append(fut)
        return fut

    def _reserve(self, keys: list[StorageKey], released: int) -> None:
        for k in keys:
            if self._released != released:
                return
            if k not in self._buffers:
                buf = self._allocate(k[2])
                with self._lock:
                    kept = self._buffers.setdefault(k, buf) if self._released == released else None
                if kept is not buf:  # a save allocated it meanwhile, or the pool was released
                    self._free([buf])

    def wait_reserved(self) -> None:
        """Wait for the reservations in flight (a failure only means the save allocates what is missing)."""
        with self._lock:
            pending, self._reserving = self._reserving, []
        for fut in pending:
            try:
                fut.result()
            except Exception as e:
                log.warning("reserving %s host buffers failed (the save allocates them): %s", self._name, e)

    def keep_only(self, used: set[StorageKey]) -> None:
        """Free the buffers of storages the last save did not use (the state dict changed)."""
        with self._lock:
            stale = [k for k in self._buffers if k not in used]
            freed = [self._buffers.pop(k) for k in stale]
        self._free(freed)

    def release(self) -> None:
        """Free every buffer, and drop what reservations in flight make: a save staged nothing of this
        kind (a loop that saves the model alone must not keep the optimizer state's host copy)."""
        with self._lock:
            self._released += 1
            freed, self._buffers = list(self._buffers.values()), {}
        self._free(freed)

    def sizes(self) -> dict[int, int]:
        with self._lock:
            return {b.data_ptr(): b.numel() for b in self._buffers.values()}

    def close(self) -> None:
        self.wait_reserved()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        with self._lock:
            freed, self._buffers = list(self._buffers.values()), {}
        self._free(freed)

    def _free(self, bufs: list[torch.Tensor]) -> None:
        if self.pin:
            for b in bufs:
                _unregister(b)
