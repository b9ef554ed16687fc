"""The one way the tests start gloo ranks.

`launch(fn, *args, world=N)` starts N processes, each running `fn(rank, world, init_file, *args)`, and
each rank's `fn` starts with `join(rank, world, init_file)`. Functions handed over run in fresh children
(forked by a forkserver with torch imported, or spawned), so they live in importable modules. A run still
going at its deadline is killed and fails the test as a hang instead of blocking the suite.

A rank whose `fn` returns ends through `end_rank()`, without the interpreter's teardown: a C++ thread
torch leaves behind (FSDP2, a full state dict's gather, DCP's async saves, the groups' gloo workers) is
destroyed still joinable there now and then, and the rank aborts after its work succeeded ("terminate
called without an active exception"). A rank's exception still fails it as before, its traceback reported.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any


def join(rank: int, world: int, init_file: str) -> None:
    """Join the launch's default gloo group (rendezvous through the shared init file)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)


def end_rank() -> None:
    """End this process now, its work done and its files written: wait for the other ranks still in the
    default group, destroy it, flush, `os._exit(0)`. Every rank that keeps the group up to its end must
    get here (a rank that destroyed it, or never joined, skips the barrier)."""
    import torch.distributed as dist

    _no_stager_left_open()
    if dist.is_initialized():
        try:
            dist.barrier()
        except Exception:  # a peer left first (it raised, or ended by itself): its own exit code tells
            pass
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _no_stager_left_open() -> None:
    # os._exit skips stagerd's exit hook, which closes a forgotten Stager and so commits its pending saves.
    shutdown = sys.modules.get("stagerd.training.shutdown")
    if shutdown is not None and len(shutdown._State.open_stagers):
        raise AssertionError("a Stager is still open: close it, or launch(..., teardown=True)")


# What every rank imports, imported once per test process by the forkserver that forks the ranks which end
# by `end_rank()` (the most): each starts with torch loaded instead of importing it again (~2 s of CPU).
# A rank that must end through the interpreter's teardown is spawned: a forked one ends by `os._exit`.
PRELOAD = ["torch", "torch.distributed", "torch.distributed.tensor", "torch.distributed.checkpoint"]


def _rank(
    rank: int,
    fn: Callable[..., None],
    teardown: bool,
    env: dict[str, str],
    world: int,
    init_file: str,
    *args: Any,
) -> None:
    if os.environ != env:  # the forkserver's environment is the one of the launch that started it
        os.environ.clear()
        os.environ.update(env)
    fn(rank, world, init_file, *args)
    if not teardown:
        end_rank()


def launch(
    fn: Callable[..., None], *args: Any, world: int = 2, deadline_s: float = 300.0, teardown: bool = False
) -> None:
    """Run `fn(rank, world, init_file, *args)` on `world` new ranks; a rank's exception fails the call.
    `teardown=True`: a rank that returns exits through the interpreter's teardown (atexit hooks and all),
    for the tests of what happens at a process's exit."""
    import multiprocessing

    import torch.multiprocessing as mp

    method = "spawn" if teardown else "forkserver"
    if not teardown:
        multiprocessing.get_context(method).set_forkserver_preload(PRELOAD)
    fd, init_file = tempfile.mkstemp(prefix="stagerd-test-gloo-")
    os.close(fd)
    os.unlink(init_file)  # the file rendezvous wants a path that does not exist yet
    ctx = mp.start_processes(
        _rank,
        args=(fn, teardown, dict(os.environ), world, init_file, *args),
        nprocs=world,
        start_method=method,
        join=False,
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
