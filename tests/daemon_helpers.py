"""Helpers for the daemon tests: staged steps, `stagerd watch` subprocesses, and reading what they did.

Run as a module it is a small training job: `python -m tests.daemon_helpers train ROOT --steps 3` starts a
gloo world whose ranks save DTensor state dicts with `stagerd.Stager`, one step every `--every` seconds;
step N holds `mixed_tensors(seed=N)`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import socket
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.cli_helpers import REPO, STAGERD, clean_env
from tests.export_index import export_index
from tests.gloo import join, launch

# What makes a journal of this stagerd one of schema 2, before failures kept their hints.
DROP_HINTS = ("ALTER TABLE steps DROP COLUMN error_hint", "ALTER TABLE lanes DROP COLUMN error_hint")


def stage_copy(root: Path, step: int, model_src: Path, world: int, **marker: Any) -> Path:
    """A committed step made from a real DCP save: its shards copied, then a marker written last."""
    from tests.dcp_fixtures import commit_step

    step_dir = root / f"step-{step:08d}"
    shutil.copytree(model_src, step_dir / "model")
    commit_step(step_dir, world, **marker)
    return step_dir


def truncate_a_shard(step_dir: Path) -> Path:
    """Damage a committed step the way a torn write would: its first shard loses its tail."""
    shard = sorted((step_dir / "model").glob("*.safetensors"))[0]
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 8)
    return shard


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fast_flags(*, metrics_port: int = 0) -> list[str]:
    """Settings that keep tests quick: short retries, no niceness (the machine is shared), quick rescans."""
    return [
        "--nice",
        "0",
        "--io-class",
        "none",
        "--rescan-seconds",
        "0.5",
        "--metrics-port",
        str(metrics_port),
    ]


@dataclass
class WatchProc:
    """A `stagerd watch` subprocess whose JSON-lines log goes to a file."""

    proc: asyncio.subprocess.Process
    log_path: Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    def records(self) -> list[dict[str, Any]]:
        out = []
        for line in self.log_path.read_text().splitlines():
            line = line.strip()
            if line.startswith("{"):
                try:
                    out.append(json.loads(line))
                except ValueError:
                    pass
        return out

    def text(self) -> str:
        return self.log_path.read_text()

    async def wait_for(self, pred: Callable[[dict[str, Any]], bool], timeout: float = 30.0) -> dict[str, Any]:
        """The first log record matching `pred`; fails if the daemon exits or time runs out first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for rec in self.records():
                if pred(rec):
                    return rec
            if self.proc.returncode is not None:
                raise AssertionError(f"daemon exited {self.proc.returncode} first:\n{self.text()[-4000:]}")
            await asyncio.sleep(0.05)
        if (
            self.proc.returncode is None
        ):  # where it waits, logged (`stagerd.ops.stacks`), as an operator would
            self.kill(signal.SIGUSR1)
            await asyncio.sleep(1.0)
        raise AssertionError(f"timed out after {timeout}s:\n{self.text()[-12000:]}")

    async def wait(self, timeout: float = 60.0) -> int:
        return await asyncio.wait_for(self.proc.wait(), timeout)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        self.proc.send_signal(sig)


async def start_watch(root: Path, *args: str, log_dir: Path, env: dict[str, str] | None = None) -> WatchProc:
    """Start `python -m stagerd.cli watch ROOT ARGS...`; stdout and stderr go to a log file in `log_dir`."""
    log_dir.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix="watch-", suffix=".log", dir=log_dir)
    proc = await asyncio.create_subprocess_exec(
        *STAGERD,
        "watch",
        str(root),
        *args,
        stdout=fd,
        stderr=fd,
        env=env or clean_env(),
        cwd=str(REPO),
    )
    os.close(fd)
    return WatchProc(proc, Path(name))


async def run_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> tuple[int, str, str]:
    """Run `python -m stagerd.cli ARGS...` to completion: (exit code, stdout, stderr)."""
    proc = await asyncio.create_subprocess_exec(
        *STAGERD,
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=env or clean_env(),
        cwd=str(REPO),
    )
    out, err = await asyncio.wait_for(proc.communicate(), timeout)
    return proc.returncode, out.decode(), err.decode()


def is_state(step: int, state: str, sink: str | None = None) -> Callable[[dict[str, Any]], bool]:
    """Predicate on a transition log line."""
    return lambda r: r.get("step") == step and r.get("state") == state and r.get("sink") == sink


def manifests(sink_dir: Path) -> dict[int, dict[str, Any]]:
    """step -> the published manifest, for every step committed at a file:// sink."""
    out = {}
    for m in sink_dir.glob("step-*/stagerd.manifest.json"):
        doc = json.loads(m.read_text())
        out[doc["step"]] = doc
    return out


def read_published(step_dir: Path) -> dict[str, Any]:
    """Every tensor of a published step, read with safetensors (no pickle)."""
    from safetensors.torch import load_file

    index = export_index(step_dir)
    tensors: dict[str, Any] = {}
    for name in sorted(set(index["weight_map"].values())):
        tensors.update(load_file(step_dir / name))
    assert set(tensors) == set(index["weight_map"]), "index and files disagree"
    return tensors


def same_bytes(a: Any, b: Any) -> bool:
    """Bitwise equality of two tensors of any dtype (fp8 and bool included)."""
    import torch

    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)
    )


# -- the training job --------------------------------------------------------------------------------------


def _train_rank(rank: int, world: int, init_file: str, root: str, steps: list[int], every: float) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from stagerd.training.stager import Stager
    from tests.dcp_fixtures import _local_block, mixed_tensors

    join(rank, world, init_file)
    try:
        mesh1 = init_device_mesh("cpu", (world,))
        mesh2 = init_device_mesh("cpu", (2, world // 2))
        stager = Stager(root, checkpointer="thread")
        for step in steps:
            sd = {}
            for name, (full, code) in mixed_tensors(step).items():
                if code == "L":
                    sd[name] = full
                    continue
                mesh = mesh2 if code == "B01" else mesh1
                local, placements = _local_block(full, code, mesh)
                sd[name] = DTensor.from_local(
                    local, mesh, placements, run_check=False, shape=full.shape, stride=full.stride()
                )
            stager.save(sd, step, extras={"config.json": {"model_type": "tiny", "step": step}})
            stager.wait()
            time.sleep(every)
        stager.close()
    finally:
        dist.destroy_process_group()


def train(root: Path, steps: list[int], world: int = 2, every: float = 0.5) -> None:
    """A real multi-process training job that saves `steps` with the Stager."""
    launch(_train_rank, str(root), steps, every, world=world)


class Appender:
    """A save in flight: appends 64 KiB to `path` every 50 ms until stopped (the daemon's yield tests)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            with open(self.path, "ab") as f:
                f.write(b"\0" * 65536)
            self._stop.wait(0.05)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def aged(d: Path, when: float) -> None:
    """Every entry under `d`, and `d`, last written at `when` (links themselves, not what they name)."""
    for p in [*sorted(d.rglob("*"), reverse=True), d]:
        os.utime(p, (when, when), follow_symlinks=False)


def yields(step: int, stage: str) -> Callable[[dict[str, Any]], bool]:
    """The log record of `stage` of `step` yielding to a save."""
    return lambda r: r.get("step") == step and r.get("stage") == stage and "yields_to" in r


def yield_seconds(port: int, stage: str) -> float:
    """`stagerd_yield_seconds_total` of `stage` on the daemon's metrics port."""
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    prefix = f'stagerd_yield_seconds_total{{stage="{stage}"}}'
    return float(next(ln for ln in body.splitlines() if ln.startswith(prefix)).split()[-1])


async def stop_cleanly(w: WatchProc) -> None:
    """SIGTERM, and the daemon exits 0 within 30 s."""
    w.kill(15)
    assert await w.wait(30) == 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train")
    t.add_argument("root", type=Path)
    t.add_argument("--steps", type=int, nargs="+", default=[10, 20, 30])
    t.add_argument("--world", type=int, default=2)
    t.add_argument("--every", type=float, default=0.5)
    a = ap.parse_args()
    train(a.root, a.steps, a.world, a.every)
