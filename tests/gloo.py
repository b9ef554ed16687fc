"""The one way the tests start gloo ranks.

`launch(fn, *args, world=N)` spawns N processes, each running `fn(rank, world, init_file, *args)`, and
each rank's `fn` starts with `join(rank, world, init_file)`. Functions handed over run in spawned
children, so they live in importable modules. A run still going at its deadline is killed and fails the
test as a hang instead of blocking the suite.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable
from typing import Any


def join(rank: int, world: int, init_file: str) -> None:
    """Join the launch's default gloo group (rendezvous through the shared init file)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)


def launch(fn: Callable[..., None], *args: Any, world: int = 2, deadline_s: float = 300.0) -> None:
    """Run `fn(rank, world, init_file, *args)` on `world` spawned ranks; a rank's exception fails the call."""
    import torch.multiprocessing as mp

    fd, init_file = tempfile.mkstemp(prefix="stagerd-test-gloo-")
    os.close(fd)
    os.unlink(init_file)  # the file rendezvous wants a path that does not exist yet
    ctx = mp.start_processes(
        fn, args=(world, init_file, *args), nprocs=world, start_method="spawn", join=False
    )
    end = time.monotonic() + deadline_s
    try:
        while not ctx.join(timeout=max(0.1, end - time.monotonic())):
            if time.monotonic() >= end:
                alive = [r for r, p in enumerate(ctx.processes) if p.is_alive()]
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                raise AssertionError(f"ranks {alive} still running after {deadline_s:.0f} s: a hang")
    finally:
        if os.path.exists(init_file):
            os.unlink(init_file)
