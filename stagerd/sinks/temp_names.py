"""The temp names a sink's writers use on a file:// store, and the host they say: whose a leftover is.

A file:// sink may be one directory that many hosts (NFS) write: a temp name says which host's process
writes it, `.NAME.tmp-HOST-PID-TID`, HOST with no `-` so the name parses one way. An older stagerd's (and
layout.write_bytes_atomic's) `.NAME.tmp-PID[-TID]` says no host. The S3 probe's scratch keys say HOST-PID
the same way (`s3/conditions.py`), and so do restore leases (`leases.py`) and a restore's temp directory.

HOST is the host name and this process's pid namespace, `NAME_pidnsINODE` (the inode of /proc/self/ns/pid;
`NAME_pidns` where it cannot be read): a pid says something only in its own namespace, and the containers of
one Kubernetes pod (or `docker run --uts host`) share a host name but not their pids, so a live writer in
the next container must not look dead here. A leftover whose HOST is this one and whose pid is dead here is
a killed writer's and goes at once; any other's only by age, an older stagerd's hostname-only HOST too (it
may be the next container's live writer). Which host's filesystem a ROOT is stays the plain host name
(`claims.py`): two containers' ROOTs are told apart there by ROOT's identity.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
import threading
import time
from pathlib import Path

from stagerd.ops.processes import PID_NS, pid_alive

# A restore writes its temp directory without pause: one unwritten for an hour is a killed restore's (as
# `local.TEMP_STALE_S` judges a file:// sink's temp files).
STALE_S = 3600.0
CLOCK_PROBE = "stagerd-clock"  # `_clock`'s probe, `.stagerd-clock.tmp-HOST-PID-TID`


# a host name alone is what an older stagerd wrote: with `_pidns` always there, its names are never this HOST
HOST = f"{re.sub(r'[^A-Za-z0-9.]', '_', socket.gethostname())[:64] or '_'}_pidns{PID_NS}"
OWNER = re.compile(r"(?P<host>[A-Za-z0-9._]+)-(?P<pid>\d+)-\d+")
_OLD_RESTORE = re.compile(r"\.restore-\d+")  # an older stagerd's restore temp directory, `.NAME.restore-PID`
TEMP_NAME = re.compile(r"\..+\.tmp-(?:(?P<host>[A-Za-z0-9._]+)-(?P<pid>\d+)-\d+|(?P<old>\d+)(?:-\d+)?)")


def owner(host: str = HOST) -> str:
    """`HOST-PID-TID`: this thread of this process, as temp names and restore leases say it (`OWNER`)."""
    return f"{host}-{os.getpid()}-{threading.get_ident()}"


def temp_name(path: Path, host: str = HOST) -> Path:
    """This thread's temp name for `path`, beside it."""
    return path.with_name(f".{path.name}.tmp-{owner(host)}")


def killed_here(host: str | None, pid: str | int | None) -> bool:
    """Whether a name's writer was a process of this host and pid namespace that is gone: its leftover is
    for good."""
    return host == HOST and pid is not None and not pid_alive(int(pid))


def sweep_beside(path: Path) -> None:
    """Remove the temp names of `path` (files or directories, beside it) that a killed process left:
    this host's and pid namespace's (`.NAME.tmp-HOST-PID-TID`, its pid dead) at once; another host's or
    container's, and an older stagerd's (its host name alone, or `.NAME.restore-PID`: either may be the
    next container's live restore), once nothing in them was written for `STALE_S` by the clock of the
    directory they are in (the mtime of a directory made there now). A live writer's stays. The clock's
    own probes (`_clock`) are judged so too: a process killed while it read the clock left its own."""
    try:
        names = os.listdir(path.parent)
    except OSError:
        return
    now: float | None = None
    prefixes = (f".{path.name}.tmp-", f".{CLOCK_PROBE}.tmp-")
    for name in names:
        m = TEMP_NAME.fullmatch(name) if name.startswith(prefixes) else None
        old = _OLD_RESTORE.fullmatch(name.removeprefix(f".{path.name}")) is not None
        other = old or (m is not None and m["host"] != HOST)
        p = path.parent / name
        if other:
            now = _clock(path.parent) if now is None else now
            if now - _newest_write(p) <= STALE_S:
                continue
        elif m is None or not killed_here(m["host"], m["pid"]):
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)


def _clock(where: Path) -> float:
    """The time now by `where`'s filesystem (on NFS, the server's): the mtime of a directory made there."""
    probe = temp_name(where / CLOCK_PROBE)
    try:
        probe.mkdir()
        try:
            return probe.stat().st_mtime
        finally:
            probe.rmdir()
    except OSError:
        return time.time()


def _newest_write(p: Path) -> float:
    """The newest mtime in the tree `p` (never through a link): when its writer last wrote there."""
    try:
        newest = p.lstat().st_mtime
    except OSError:
        return time.time()  # gone, or unreadable: nothing to judge, so it is young
    for top, dirs, files in os.walk(p):
        for name in (*dirs, *files):
            with contextlib.suppress(OSError):
                newest = max(newest, os.lstat(os.path.join(top, name)).st_mtime)
    return newest


def restore_temp(out: Path) -> Path:
    """The temp directory a restore builds `out` in, beside it (renamed to `out` once whole), after what
    killed restores of `out` left there is removed (`sweep_beside`)."""
    sweep_beside(out)
    tmp = temp_name(out)
    shutil.rmtree(tmp, ignore_errors=True)
    return tmp
