"""The daemon holds each input file of an export open while it runs (a link swapped in later must lead no
read elsewhere), so a checkpoint of many shards needs many descriptors at once: more than a soft
RLIMIT_NOFILE of 1024 (a common default) allows for a save of some hundreds of ranks. stagerd raises its
soft limit to the hard one at start."""

from __future__ import annotations

import resource
from pathlib import Path

import pytest
import torch

from stagerd.contract import layout
from tests.cli_helpers import run_cli
from tests.daemon_helpers import fast_flags
from tests.dcp_fixtures import commit_step

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

SHARDS = 96
SOFT = 128  # the interpreter and its imports hold about 20 at start


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


def test_a_step_of_more_shards_than_the_soft_limit_allows_is_exported(tmp_path):
    root, sink = tmp_path / "root", tmp_path / "sink"
    step = root / layout.step_dir_name(7)
    _many_shards(step)
    assert len(list((step / "model").glob("*.safetensors"))) == SHARDS

    def low_soft_limit() -> None:
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        resource.setrlimit(resource.RLIMIT_NOFILE, (SOFT, hard))

    res = run_cli(["watch", root, "--sink", sink.as_uri(), "--once", *fast_flags()], preexec=low_soft_limit)
    assert res.returncode == 0, res.stderr[-3000:]
    assert (sink / layout.step_dir_name(7) / layout.MANIFEST_NAME).is_file()


def test_a_process_out_of_descriptors_is_not_told_its_shards_are_broken(tmp_path):
    """Where the hard limit is too low too, the export cannot open its shards: a retryable `ResourceError`
    that names the limit and is tried again, not a `ShardError` that quarantined the step at once as
    incomplete ("re-save it")."""
    root, sink = tmp_path / "root", tmp_path / "sink"
    _many_shards(root / layout.step_dir_name(7))

    def low_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (SOFT, SOFT))

    args = ["watch", root, "--sink", sink.as_uri(), "--once", "--max-attempts", "2", *fast_flags()]
    res = run_cli(args, preexec=low_limit)
    assert res.returncode != 0
    assert "ResourceError" in res.stderr and "Too many open files" in res.stderr
    assert "ShardError" not in res.stderr and "LimitNOFILE" in res.stderr
    assert '"exporting", "error_class": null, "attempt": 2' in res.stderr  # tried again, not given up at once
