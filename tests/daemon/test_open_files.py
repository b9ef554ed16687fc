"""The daemon holds each input file of an export open while it runs (a link swapped in later must lead no
read elsewhere), so a checkpoint of many shards needs many descriptors at once: more than a soft
RLIMIT_NOFILE of 1024 (a common default) allows for a save of some hundreds of ranks. stagerd raises its
soft limit to the hard one at start, and reads a step of more files than even the hard limit allows
through a bounded number of descriptors (`contract/step/reopen.py`)."""

from __future__ import annotations

import resource
import shutil
from pathlib import Path

import pytest
import torch

from stagerd.contract import commit_marker, layout
from tests.cli_helpers import run_cli
from tests.daemon_helpers import fast_flags
from tests.dcp_fixtures import commit_step

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

SHARDS = 96
SOFT = 128  # the interpreter and its imports hold about 20 at start
TOO_FEW = 16  # the daemon starts, but cannot hold even the few files the bounded reads need
HARD = 64  # fewer than the step's files: the export and the raw lane hold some, and open the rest again


def _many_shards(step_dir: Path) -> dict[str, torch.Tensor]:
    """One rank's DCP save in the Hugging Face layout, one tensor per file: SHARDS shard files."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    sd = {f"layers.{i}.weight": torch.full((4, 4), float(i)) for i in range(SHARDS)}
    model = step_dir / "model"
    model.mkdir(parents=True)
    writer = HuggingFaceStorageWriter(
        str(model), fqn_to_index_mapping={k: i + 1 for i, k in enumerate(sd)}, save_distributed=True
    )
    dcp.save(sd, storage_writer=writer, no_dist=True)
    commit_step(step_dir, 1)
    return sd


@pytest.fixture(scope="module")
def many(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    """A committed step of SHARDS shard files (saved once; each test exports a copy) and its tensors."""
    step = tmp_path_factory.mktemp("many") / layout.step_dir_name(7)
    return step, _many_shards(step)


def _root(tmp_path: Path, many: tuple[Path, dict[str, torch.Tensor]]) -> Path:
    root = tmp_path / "root"
    shutil.copytree(many[0], root / many[0].name)
    return root


def test_a_step_of_more_shards_than_the_soft_limit_allows_is_exported(tmp_path, many):
    root, sink = _root(tmp_path, many), tmp_path / "sink"
    assert len(list((root / layout.step_dir_name(7) / "model").glob("*.safetensors"))) == SHARDS

    def low_soft_limit() -> None:
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        resource.setrlimit(resource.RLIMIT_NOFILE, (SOFT, hard))

    res = run_cli(["watch", root, "--sink", sink.as_uri(), "--once", *fast_flags()], preexec=low_soft_limit)
    assert res.returncode == 0, res.stderr[-3000:]
    assert (sink / layout.step_dir_name(7) / layout.MANIFEST_NAME).is_file()


def test_a_step_of_more_shards_than_the_hard_limit_allows_is_exported_and_sent_raw(tmp_path, many):
    """More shard files than the hard limit allows (8,192 ranks under 4,096): the export held two
    descriptors per shard and the raw lane one per file, so every try was a retryable ResourceError and the
    step was never published. Now both hold a bounded number and open the rest again when they read them:
    the export has every tensor, the raw tree every file, each byte for byte."""
    from safetensors.torch import load_file

    root, sink = _root(tmp_path, many), tmp_path / "sink"
    step = root / layout.step_dir_name(7)

    def low_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (HARD, HARD))

    args = ["watch", root, "--sink", sink.as_uri(), "--once", "--publish-raw", "--max-attempts", "1"]
    res = run_cli([*args, *fast_flags()], preexec=low_limit)
    assert res.returncode == 0, res.stderr[-3000:]
    published = sink / step.name
    got = {k: v for f in sorted(published.glob("*.safetensors")) for k, v in load_file(f).items()}
    assert got.keys() == many[1].keys() and all(torch.equal(got[k], v) for k, v in many[1].items())
    raw = sink / "raw" / step.name
    assert (raw / layout.MANIFEST_NAME).is_file()
    for f in commit_marker.read_marker(step).files:
        assert (raw / f.path).read_bytes() == (step / f.path).read_bytes()


def test_a_process_out_of_descriptors_is_not_told_its_shards_are_broken(tmp_path, many):
    """Where the limit leaves too few even for the bounded reads, the export cannot open its shards: a
    retryable `ResourceError` that names the limit and is tried again, not a `ShardError` that quarantined
    the step at once as incomplete ("re-save it")."""
    root, sink = _root(tmp_path, many), tmp_path / "sink"

    def low_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (TOO_FEW, TOO_FEW))

    args = ["watch", root, "--sink", sink.as_uri(), "--once", "--max-attempts", "2", *fast_flags()]
    res = run_cli(args, preexec=low_limit)
    assert res.returncode != 0
    assert "ResourceError" in res.stderr and "Too many open files" in res.stderr
    assert "ShardError" not in res.stderr and "LimitNOFILE" in res.stderr
    assert '"exporting", "error_class": null, "attempt": 2' in res.stderr  # tried again, not given up at once
