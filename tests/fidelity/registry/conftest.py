"""The registry tests' Stager: one per test file, saving each case as the next step of one root."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest


class RegistryRun:
    """Runs cases one after another through one Stager, keeping the last model alive: the Stager caches
    its to-Hub plan by the model's id, which a freed model's successor could otherwise reuse."""

    def __init__(self, stager, tmp: Path) -> None:
        self.stager, self.tmp, self.step, self.last = stager, tmp, 0, None

    def run(self, case) -> None:
        from tests.fidelity.registry.check import check

        self.step += 1
        self.last = check(case, self.stager, self.step, self.tmp)


@pytest.fixture(scope="module")
def registry_run(tmp_path_factory):
    from stagerd import Stager

    # In memory where the machine has room for it (a container's /dev/shm may be 64 MiB): these tests
    # prove bytes, not durability, and each export fsyncs every file it writes.
    shm = Path("/dev/shm")
    roomy = shm.is_dir() and os.access(shm, os.W_OK) and shutil.disk_usage(shm).free > 1 << 30
    tmp = (
        Path(tempfile.mkdtemp(prefix="stagerd-registry-", dir=shm))
        if roomy
        else tmp_path_factory.mktemp("reg")
    )
    try:
        with Stager(tmp / "root", checkpointer="thread") as stager:
            yield RegistryRun(stager, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
