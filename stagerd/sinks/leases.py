"""Restore leases: while `stagerd restore` reads a step, remote retention leaves it alone.

A lease is an object `PREFIX/restoring/step-N.HOST-PID-TID` (its holder, as temp names say it:
`temp_names.py`) that the restore writes when it starts, writes again every `LEASE_RENEW_S` while it runs
(a thread of its own), and deletes when it ends. A prune judges
a lease by its age on the **store's** clock: the lease's LastModified (file://: its mtime) against the
store's time now (`RemoteStore.clock`: S3's `Date`, or the mtime of a file written now), so a pruner and
a restorer whose clocks disagree by hours still agree on it, and a restore longer than the TTL stays
protected because its renewals keep the lease young. A lease not renewed for `LEASE_TTL_S` (the restore
was killed) no longer protects anything; nor does one whose holder was a process of this host now gone.
"This host" is its name and its pid namespace (HOST, `temp_names.py`): a restore in the next container
of a pod (the same host name, other pids) is judged by its lease's age, as another host's is.

A killed restore's lease is removed by the next restore of the sink (`sweep`): at once when it was this
host's (its pid is dead), else once its TTL is over on the store's clock (the new lease's LastModified is
that clock's now); with it go the temp files a killed lease write left on file://. An older stagerd's
`step-N.<random>`, or its `step-N.HOSTNAME-PID-TID` (no namespace), is judged by its age alone.

A restore writes its lease before it reads anything of the step, then reads the step's claim and stops
where a prune holds it (`refuse_pruning`); a prune takes the step's claims, then lists `restoring/` once
more before it deletes (`prune.delete_step`). Whichever comes second sees the other's write, so a restore
never reads a step a prune deletes: the prune leaves the step, or the restore fails before it read any of
it (`StepVanishedError`, retryable: a restore without --step then takes the newest step).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
from collections.abc import Mapping

from stagerd.contract import layout
from stagerd.errors import SinkError, StepVanishedError
from stagerd.ops.processes import PID_NS
from stagerd.sinks import claims
from stagerd.sinks.remote import RemoteStore, StoredObject
from stagerd.sinks.temp_names import OWNER, TEMP_NAME, killed_here, owner

log = logging.getLogger("stagerd.sinks.prune")

RESTORING_DIR = "restoring"
LEASE_TTL_S = 900.0
LEASE_RENEW_S = 120.0


def _holder_dead(rel: str) -> bool:
    m = OWNER.fullmatch(rel.split(".", 1)[1]) if "." in rel else None
    return m is not None and killed_here(m["host"], m["pid"])


def live_leases(leases: Mapping[str, StoredObject], now: float, ttl: float = LEASE_TTL_S) -> set[int]:
    """Steps with a lease younger than `ttl` on the store's clock (`now` and each LastModified), whose
    holder is not a dead process of this host."""
    out = set()
    for rel, obj in leases.items():
        step = layout.parse_step_dir(rel.split(".", 1)[0])
        if step is not None and (obj.mtime is None or now - obj.mtime < ttl) and not _holder_dead(rel):
            out.add(step)
    return out


def dead_leases(leases: Mapping[str, StoredObject], now: float | None, ttl: float = LEASE_TTL_S) -> list[str]:
    """What killed restores left under `restoring/` (relative names): leases and file:// temp files of a
    dead process of this host, and any older than `ttl` on the store's clock (`now`; None: unknown).
    Only a lease's name (`step-N.…`) or a temp name of one: anything else there is not a restore's."""
    out = []
    for rel, obj in leases.items():
        m = TEMP_NAME.fullmatch(rel)
        name = rel if m is None else rel[1:].rsplit(".tmp-", 1)[0]
        if "/" in rel or "." not in name or layout.parse_step_dir(name.split(".", 1)[0]) is None:
            continue
        dead = _holder_dead(rel) if m is None else killed_here(m["host"], m["pid"])
        stale = now is not None and obj.mtime is not None and now - obj.mtime > ttl
        if dead or stale:
            out.append(rel)
    return out


def refuse_pruning(store: RemoteStore, prefix: str, step: int) -> None:
    """`StepVanishedError` where a prune holds the claim of the step at `prefix` (live or killed: either
    way the step is on its way out); read with this restore's lease written (module docstring)."""
    held = claims.decode(claims.read_claim(store, claims.claim_key(prefix)))
    if held is not None and held.kind == claims.PRUNE:
        raise StepVanishedError(
            f"step {step} is being deleted by {held.describe()}; nothing of it was read",
            path=store.where(prefix),
        )


class Lease:
    """A restore's lease on one step, renewed while it is held (a context manager)."""

    def __init__(self, store: RemoteStore, step: int, *, renew: float = LEASE_RENEW_S) -> None:
        self.store, self.step, self.renew = store, step, renew
        self.key = f"{RESTORING_DIR}/{layout.step_dir_name(step)}.{owner()}"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _write(self) -> bool:
        body = {"step": self.step, "host": socket.gethostname(), "pid": os.getpid(), "pidns": PID_NS}
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
            self.sweep()
        return self

    def sweep(self) -> None:
        """Delete the leases killed restores left (`dead_leases`); a failure only warns."""
        try:
            found = self.store.objects(RESTORING_DIR)
            own = found.get(self.key.split("/", 1)[1])
            dead = dead_leases(found, own.mtime if own is not None else None)
            if dead:
                self.store.delete([f"{RESTORING_DIR}/{rel}" for rel in dead])
                log.info(
                    "removed %d lease(s) of killed restores under %s",
                    len(dead),
                    self.store.where(RESTORING_DIR),
                )
        except (OSError, SinkError) as e:
            log.warning("cannot remove the leases of killed restores: %s", e)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        try:
            self.store.delete([self.key])
            self.store.remove_empty_dirs(RESTORING_DIR)  # file://: no empty restoring/ left behind
        except (OSError, SinkError) as e:
            log.warning("cannot delete the restore lease %s: %s", self.store.where(self.key), e)
