"""Tensor parallelism, alone and beside FSDP2 or as HSDP, on 4 gloo ranks: each block is staged once, and
the export is what `save_pretrained` writes, byte for byte.

Under FSDP2 on the dp dim of a dp x tp mesh, a parameter that is not tensor-parallel (a norm, tied
embeddings) is a DTensor on the dp sub-mesh alone: every tp rank holds the same block of it, which its
placements do not say. Each tp group used to write it, and the export refused the step (its chunks
overlap)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from stagerd.contract import layout
from stagerd.engine.export import build_export
from stagerd.engine.source import open_source
from tests.fidelity import harness
from tests.gloo import launch
from tests.training import tp_ranks

pytestmark = pytest.mark.slow


def staged_bytes(step: Path) -> int:
    """The tensor bytes of every rank's model shard in the step."""
    total = 0
    for f in sorted((step / layout.MODEL_DIR).glob("*.safetensors")):
        with f.open("rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        total += sum(
            e["data_offsets"][1] - e["data_offsets"][0] for k, e in header.items() if k != "__metadata__"
        )
    return total


CASES = [("fsdp_tp", False), ("fsdp_tp", True), ("tp", False), ("hsdp", False)]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Every case saved in one launch (starting 4 ranks costs more than a save); each rank also checks
    that a step of FSDP2 + TP with its optimizer state loads back (`tp_ranks.resume`)."""
    out = tmp_path_factory.mktemp("tp")
    launch(tp_ranks.save, CASES, str(out), world=4, deadline_s=150)
    return out


@pytest.mark.parametrize(("mesh", "tied"), CASES)
def test_tensor_parallel_export_is_what_save_pretrained_writes(mesh, tied, saved, tmp_path):
    d = saved / tp_ranks.case_dir(mesh, tied)
    step = d / "root" / layout.step_dir_name(1)
    model = tp_ranks.build(tied)
    once = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    if tied:
        once -= model.lm_head.weight.numel() * model.lm_head.weight.element_size()
    assert staged_bytes(step) == once  # each block written by one rank
    for mode, dtype in (("keep", None), ("bf16", "BF16")):
        out = tmp_path / f"out-{mode}"
        out.mkdir()
        build_export(
            open_source(step), out, dtype=dtype, keep_dtype=None, reference=None, max_shard_size=1 << 40,
            threads=1, progress=None,
        )  # fmt: skip
        harness.assert_same_tensors(out, d / "ref" / mode)
        harness.assert_same_weight_files(out, d / "ref" / mode)
