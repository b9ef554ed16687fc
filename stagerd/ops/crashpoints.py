"""TEST ONLY: named crash points, so the crash-injection tests can SIGKILL the daemon at an exact place.

`crash_point("name")` does nothing unless the environment variable `STAGERD_CRASH_AT` names that point when
this module is first imported: `name` kills the process the first time the point is reached, `name:N` the
N-th time (counted over every thread of the process). The kill is a real `SIGKILL` of the current process:
no `finally`, no atexit, no flush, exactly what an OOM kill or a power cut leaves behind.

Production never sets the variable; unset, a call costs one global lookup and one comparison. The points
are listed in `POINTS` (the tests check every one is reached) and documented in RELIABILITY.md.

`delay_point("name")` sleeps instead, when `STAGERD_DELAY_AT=name:SECONDS` names one of `DELAYS`: a race
between two processes (two publishers of one step) is widened there, so that a test reproduces it every
time; it logs one line to stderr when it starts sleeping, which the test waits for, and it ends early once
the file `STAGERD_DELAY_RELEASE` names exists.

A point needs a stagerd line to sit on. Inside huggingface_hub's LFS upload there is none, so that kill
comes from outside: the Hub test server SIGKILLs the daemon once an upload body is partly received
(`HubServer.on_lfs_body` in `tests/hubserver/`, used by `tests/daemon/crash/test_injection.py`).
"""

from __future__ import annotations

import os
import signal
import threading
import time

ENV = "STAGERD_CRASH_AT"

POINTS = {
    "export.move": "export: after a byte move into the pre-allocated output files (mid-file)",
    "export.extra": "export: between files, before an extra (config, tokenizer) is copied",
    "export.renamed": "export: export.tmp/ renamed to export/, before the journal records it",
    "s3.part": "S3 sink: a multipart part uploaded, the upload not completed",
    "s3.probe": "S3 sink: the conditions probe's scratch keys written, not yet answered or deleted",
    "file.upload": "file:// sink: a file written to its temp name, not yet renamed into the step",
    "file.create": "file:// sink: a claim or manifest written to its temp name, not yet linked into place",
    "fsspec.manifest": "fsspec sink: the manifest written, `latest` not yet moved",
    "hub.commit": "Hub sink: the commit made and verified, the step-N tag not yet created",
    "publish.done": "daemon: a sink returned a verified publish, before the journal records it",
    "retention.trashed": "retention: a step renamed into the trash, before the journal retires it",
    "retention.rmtree": "retention: before a trash entry is removed",
    "restore.piece": "restore: a piece of a file (from the Hub: a file) downloaded and written, not all yet",
    "restore.landed": "restore: the step renamed into ROOT without its marker, the journal not written",
    "restore.journaled": "restore: the journal records the step as restored, its marker not yet written",
    "prune.tombstone": "remote prune: the step's claims taken (its tombstone), its manifest not yet deleted",
    "prune.manifest": "remote prune: a step's manifest deleted, its files not yet",
    "prune.clock": "remote prune (file://): the store's time read from a file written there, not yet removed",
    "prune.files": "remote prune: a step's files deleted, its empty directories (file://) and claim not yet",
    "fleet.raw_upload": "fleet export: part of this node's raw part on the exchange, no raw manifest yet",
    "fleet.build": "fleet export: an owned file being built (a byte move into it done), not yet uploaded",
    "fleet.built": "fleet export: an owned file uploaded to the sink, its completion record not yet written",
    "fleet.commit": "fleet export: the leader checked every file's record and the listing, no manifest yet",
    "fleet.manifest": "fleet export: the leader created the manifest, `latest` not yet moved",
}


DELAY_ENV = "STAGERD_DELAY_AT"
RELEASE_ENV = "STAGERD_DELAY_RELEASE"

DELAYS = {
    "publish.opened": "fsspec sink: a step opened (claim settled, manifest looked for), nothing uploaded yet",
    "save.marker": "Stager: every part of a save written, holding the step's lock, the marker not yet",
    "restore.landing": "restore: the step downloaded and checked, holding the step's lock, not yet landed",
    "restore.piece": "restore: a piece of a file downloaded and written under the step's lease, not all yet",
    "prune.decided": "remote prune: restore leases listed and a step's fate decided, before it is acted on",
    "prune.tombstone": "remote prune: the step's claims taken and its leases read again, nothing deleted",
    "adopt.open": "adopt: a finished checkpoint's export begun, the checkpoint not yet opened",
    "adopt.built": "adopt: a checkpoint's export built in export.tmp/, its source not yet checked unchanged",
}


def _parse(value: str | None) -> tuple[str, int] | None:
    if not value:
        return None
    name, _, nth = value.strip().partition(":")
    if name not in POINTS:
        raise ValueError(f"{ENV}={value!r}: unknown crash point (known: {', '.join(sorted(POINTS))})")
    n = int(nth) if nth else 1
    if n < 1:
        raise ValueError(f"{ENV}={value!r}: N must be 1 or more")
    return name, n


_TARGET = _parse(os.environ.get(ENV))
_count = 0
_lock = threading.Lock()


def crash_point(name: str) -> None:
    """SIGKILL this process if `STAGERD_CRASH_AT` names this point and this is its N-th arrival."""
    if _TARGET is None or _TARGET[0] != name:
        return
    global _count
    with _lock:
        _count += 1
        hit = _count == _TARGET[1]
    if hit:
        os.write(2, f"stagerd: crash point {name}:{_TARGET[1]} reached ({ENV}); SIGKILL\n".encode())
        os.kill(os.getpid(), signal.SIGKILL)


def _parse_delay(value: str | None) -> tuple[str, float] | None:
    if not value:
        return None
    name, _, seconds = value.strip().partition(":")
    if name not in DELAYS:
        raise ValueError(f"{DELAY_ENV}={value!r}: unknown delay point (known: {', '.join(sorted(DELAYS))})")
    return name, float(seconds or 1)


_DELAY = _parse_delay(os.environ.get(DELAY_ENV))


def delay_point(name: str) -> None:
    """Sleep here if `STAGERD_DELAY_AT` names this point (each time it is reached): for its SECONDS, or
    until the file `STAGERD_DELAY_RELEASE` names exists, whichever comes first."""
    if _DELAY is None or _DELAY[0] != name:
        return
    os.write(2, f"stagerd: delay point {name} reached ({DELAY_ENV}); sleeping {_DELAY[1]:g} s\n".encode())
    release = os.environ.get(RELEASE_ENV)
    deadline = time.monotonic() + _DELAY[1]
    while time.monotonic() < deadline and not (release and os.path.exists(release)):
        time.sleep(0.02)
