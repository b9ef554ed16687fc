"""Running a process in a new pid namespace, as the next container of a Kubernetes pod is: `unshare`
as an unprivileged user (a user namespace maps us to root there). Tests that need it skip where the
kernel or a sandbox refuses it."""

from __future__ import annotations

import subprocess

UNSHARE = ("unshare", "--user", "--pid", "--fork", "--map-root-user")
# with /proc of its own too: it sees only its namespace's processes, as a container does
OWN_PROC = (*UNSHARE, "--mount", "--mount-proc")


def unshare_works(args: tuple[str, ...] = UNSHARE) -> bool:
    try:
        r = subprocess.run([*args, "true"], capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return r.returncode == 0
