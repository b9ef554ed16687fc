"""Shared fixtures. DCP checkpoints are real gloo multi-process saves, made once per session."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from tests.dcp_fixtures import commit_step, dcp_save

# No Xet server is reachable from the tests (production keeps Xet); no tqdm bars in test output.
os.environ.setdefault("HF_HUB_DISABLE_XET", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


@pytest.fixture(scope="session")
def dcp_mixed(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    """4 ranks: Shard(0), Shard(1), 2-D blocks, replicated, uneven, scalars, N-D, every dtype."""
    out = tmp_path_factory.mktemp("dcp_mixed") / "model"
    return out, dcp_save(out, world=4)


@pytest.fixture(scope="session")
def dcp_mixed2(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    """The same tensors saved by 2 ranks."""
    out = tmp_path_factory.mktemp("dcp_mixed2") / "model"
    return out, dcp_save(out, world=2)


@pytest.fixture
def step_dir(tmp_path, dcp_mixed) -> Path:
    """A committed step directory (a copy, so tests may damage it) with extras and a marker."""
    src, full = dcp_mixed
    step = tmp_path / "step-00000100"
    shutil.copytree(src, step / "model")
    (step / "extras").mkdir()
    (step / "extras" / "config.json").write_text('{"model_type": "tiny"}\n')
    (step / "extras" / "tokenizer.json").write_text('{"version": "1.0"}\n')
    from stagerd.contract.dtypes import safetensors_name
    from stagerd.contract.layout import TensorInfo

    tensors = {k: TensorInfo(safetensors_name(v.dtype), tuple(v.shape)) for k, v in full.items()}
    commit_step(step, world=4, tensors=tensors)
    return step
