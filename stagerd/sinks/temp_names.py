"""The temp names a sink's writers use on a file:// store, and the host they say: whose a leftover is.

A file:// sink may be one directory that many hosts (NFS) write: a temp name says which host's process
writes it, `.NAME.tmp-HOST-PID-TID`, HOST with no `-` so the name parses one way. An older stagerd's (and
layout.write_bytes_atomic's) `.NAME.tmp-PID[-TID]` says no host. The S3 probe's scratch keys say HOST-PID
the same way (`s3/conditions.py`).
"""

from __future__ import annotations

import os
import re
import socket
import threading
from pathlib import Path

HOST = re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname())[:64] or "_"
TEMP_NAME = re.compile(r"\..+\.tmp-(?:(?P<host>[A-Za-z0-9._]+)-(?P<pid>\d+)-\d+|(?P<old>\d+)(?:-\d+)?)")


def temp_name(path: Path, host: str = HOST) -> Path:
    """This thread's temp name for `path`, beside it."""
    return path.with_name(f".{path.name}.tmp-{host}-{os.getpid()}-{threading.get_ident()}")


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
