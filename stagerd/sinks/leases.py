"""Restore leases: while `stagerd restore` reads a step, remote retention leaves it alone.

A lease is an object `PREFIX/restoring/step-N.<random>` that the restore writes when it starts, writes
again every `LEASE_RENEW_S` while it runs (a thread of its own), and deletes when it ends. A prune judges
a lease by its age on the **store's** clock: the lease's LastModified (file://: its mtime) against the
store's time now (`RemoteStore.clock`: S3's `Date`, or the mtime of a file written now), so a pruner and
a restorer whose clocks disagree by hours still agree on it, and a restore longer than the TTL stays
protected because its renewals keep the lease young. A lease not renewed for `LEASE_TTL_S` (the restore
was killed) no longer protects anything.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import uuid
from collections.abc import Mapping

from stagerd.contract import layout
from stagerd.errors import SinkError
from stagerd.sinks.remote import RemoteStore, StoredObject

log = logging.getLogger("stagerd.sinks.prune")

RESTORING_DIR = "restoring"
LEASE_TTL_S = 900.0
LEASE_RENEW_S = 120.0


def live_leases(leases: Mapping[str, StoredObject], now: float, ttl: float = LEASE_TTL_S) -> set[int]:
    """Steps with a lease younger than `ttl` on the store's clock (`now` and each LastModified)."""
    out = set()
    for rel, obj in leases.items():
        step = layout.parse_step_dir(rel.split(".", 1)[0])
        if step is not None and (obj.mtime is None or now - obj.mtime < ttl):
            out.add(step)
    return out


class Lease:
    """A restore's lease on one step, renewed while it is held (a context manager)."""

    def __init__(self, store: RemoteStore, step: int, *, renew: float = LEASE_RENEW_S) -> None:
        self.store, self.step, self.renew = store, step, renew
        self.key = f"{RESTORING_DIR}/{layout.step_dir_name(step)}.{uuid.uuid4().hex}"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _write(self) -> bool:
        body = {"step": self.step, "host": socket.gethostname(), "pid": os.getpid()}
        try:
            self.store.put(self.key, json.dumps(body).encode())
            return True
        except (
            OSError,
            SinkError,
        ) as e:  # a read-only credential can still restore; say that prune cannot see it
            log.warning(
                "cannot write the restore lease %s (%s); a prune meanwhile may remove the step",
                self.store.where(self.key),
                e,
            )
            return False

    def _renew(self) -> None:
        while not self._stop.wait(self.renew):
            self._write()

    def __enter__(self) -> Lease:
        if self._write():
            self._thread = threading.Thread(target=self._renew, name="stagerd-lease", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        try:
            self.store.delete([self.key])
            self.store.remove_empty_dirs(RESTORING_DIR)  # file://: no empty restoring/ left behind
        except (OSError, SinkError) as e:
            log.warning("cannot delete the restore lease %s: %s", self.store.where(self.key), e)
