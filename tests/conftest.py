"""Shared fixtures. DCP checkpoints are real gloo multi-process saves, made once per session."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from filelock import FileLock
from hypothesis import settings

from tests.dcp_fixtures import big_tensors, commit_step, dcp_save, mixed_tensors

# Uploads take huggingface_hub's production path, Xet, against the Hub test server's CAS; hf_xet's chunk
# cache and logs go to a temp dir of this test process (and its children), not the user's. No tqdm bars.
if "HF_XET_CACHE" not in os.environ:
    os.environ["HF_XET_CACHE"] = tempfile.mkdtemp(prefix="stagerd-tests-xet-")
    atexit.register(shutil.rmtree, os.environ["HF_XET_CACHE"], ignore_errors=True)
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

# No property test fails for being slow: an example's time on a shared 2-core CI machine says nothing of
# its correctness (Hypothesis's default 200 ms deadline made a header property test flaky there).
settings.register_profile("stagerd", deadline=None)
settings.load_profile("stagerd")


def _saved_once(tmp_path_factory, name: str, world: int, builder=mixed_tensors) -> tuple[Path, dict]:
    """One gloo save per test run: under pytest-xdist the workers share it (read-only, as every session
    fixture is) through the run's common temp dir, so each worker does not pay the save again."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        out = tmp_path_factory.mktemp(name) / "model"
        return out, dcp_save(out, world=world, builder=builder)
    shared = tmp_path_factory.getbasetemp().parent / name
    with FileLock(f"{shared}.lock"):
        if not (shared / "saved").exists():
            shutil.rmtree(shared, ignore_errors=True)
            dcp_save(shared / "model", world=world, builder=builder)
            (shared / "saved").touch()
    return shared / "model", {k: v for k, (v, _) in builder().items()}


@pytest.fixture(scope="session")
def dcp_mixed(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    """4 ranks: Shard(0), Shard(1), 2-D blocks, replicated, uneven, scalars, N-D, every dtype."""
    return _saved_once(tmp_path_factory, "dcp_mixed", world=4)


@pytest.fixture(scope="session")
def dcp_mixed2(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    """The same tensors saved by 2 ranks."""
    return _saved_once(tmp_path_factory, "dcp_mixed2", world=2)


@pytest.fixture(scope="session")
def dcp_big(tmp_path_factory) -> Path:
    """`big_tensors` saved by 2 ranks: each rank's shard goes in one PUT, the big export file does not."""
    return _saved_once(tmp_path_factory, "dcp_big", world=2, builder=big_tensors)[0]


@pytest.fixture
def step_dir(tmp_path, dcp_mixed) -> Path:
    """A committed step directory (a copy, so tests may damage it) with extras and a marker."""
    src, full = dcp_mixed
    step = tmp_path / "step-00000100"
    shutil.copytree(src, step / "model")
    (step / "extras").mkdir()
    (step / "extras" / "config.json").write_text('{"model_type": "tiny"}\n')
    (step / "extras" / "tokenizer.json").write_text('{"version": "1.0"}\n')
    from stagerd.contract.commit_marker import TensorInfo
    from stagerd.contract.dtypes import safetensors_name

    tensors = {k: TensorInfo(safetensors_name(v.dtype), tuple(v.shape)) for k, v in full.items()}
    commit_step(step, world=4, tensors=tensors)
    return step


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Files with slow tests first, each file's tests still together and in order: pytest-xdist hands out
    whole files in this order, so the long ones start early instead of one of them ending the run alone."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)
