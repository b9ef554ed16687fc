"""The temp names a sink's writers use on a file:// store, and the host they say: whose a leftover is.

A file:// sink may be one directory that many hosts (NFS) write: a temp name says which host's process
writes it, `.NAME.tmp-HOST-PID-TID`, HOST with no `-` so the name parses one way. An older stagerd's (and
layout.write_bytes_atomic's) `.NAME.tmp-PID[-TID]` says no host. The S3 probe's scratch keys say HOST-PID
the same way (`s3/conditions.py`), and so do restore leases (`leases.py`) and a restore's temp directory.
A leftover of this host whose pid is dead is a killed writer's and goes at once; another host's only by age.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import threading
from pathlib import Path

HOST = re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname())[:64] or "_"
OWNER = re.compile(r"(?P<host>[A-Za-z0-9._]+)-(?P<pid>\d+)-\d+")
TEMP_NAME = re.compile(r"\..+\.tmp-(?:(?P<host>[A-Za-z0-9._]+)-(?P<pid>\d+)-\d+|(?P<old>\d+)(?:-\d+)?)")


def owner(host: str = HOST) -> str:
    """`HOST-PID-TID`: this thread of this process, as temp names and restore leases say it (`OWNER`)."""
    return f"{host}-{os.getpid()}-{threading.get_ident()}"


def temp_name(path: Path, host: str = HOST) -> Path:
    """This thread's temp name for `path`, beside it."""
    return path.with_name(f".{path.name}.tmp-{owner(host)}")


def killed_here(host: str | None, pid: str | int | None) -> bool:
    """Whether a name's writer was a process of this host that is gone: its leftover is for good."""
    return host == HOST and pid is not None and not pid_alive(int(pid))


def sweep_beside(path: Path) -> None:
    """Remove the temp names of `path` (files or directories, beside it) that a killed process of this host
    left: `.NAME.tmp-HOST-PID-TID`, and an older restore's `.NAME.restore-PID` (its pid alone says this host:
    it was always local). Another host's, or a live writer's, stay."""
    try:
        names = os.listdir(path.parent)
    except OSError:
        return
    old = re.compile(rf"\.{re.escape(path.name)}\.restore-(?P<pid>\d+)")
    for name in names:
        m = TEMP_NAME.fullmatch(name) if name.startswith(f".{path.name}.tmp-") else None
        dead = m is not None and killed_here(m["host"], m["pid"])
        o = old.fullmatch(name)
        if dead or (o is not None and not pid_alive(int(o["pid"]))):
            p = path.parent / name
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)


def restore_temp(out: Path) -> Path:
    """The temp directory a restore builds `out` in, beside it (renamed to `out` once whole), after what
    killed restores of `out` on this host left there is removed (`sweep_beside`)."""
    sweep_beside(out)
    tmp = temp_name(out)
    shutil.rmtree(tmp, ignore_errors=True)
    return tmp


_PID_MAX = 2**22  # Linux's largest pid_max


def pid_alive(pid: int) -> bool:
    """Whether `pid` is a live process on this host (ours counts as alive)."""
    if pid == os.getpid():
        return True
    if not 0 < pid <= _PID_MAX:
        return False  # no process has it (os.kill would overflow past a C int)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
