"""torchtitan's `last_save_in_hf` when its HF assets hold an index (a real model's download does): its
`dcp_save` writes the shards through torch's HuggingFaceStorageWriter into `step-N/sharded/`, then
`consolidate_safetensors_files_on_every_rank` writes `step-N/model-0000I-of-0000K.safetensors` and the
index last. Driven here with those same torch calls and arguments, in one process."""

from __future__ import annotations

import json
from pathlib import Path

from tests.adopt.helpers import published, watch_once
from tests.fidelity import models
from tests.fidelity.harness import assert_same_tensors
from tests.gloo import join, launch


def titan_hf_save(rank: int, world: int, init_file: str, tmp: str, stage: str) -> None:
    """torchtitan's `dcp_save(..., to_hf=True)` with an index, on a gloo group as torchtitan runs it:
    `save` the shards, or `consolidate` them (the overall index is written only on a group)."""
    join(rank, world, init_file)
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.checkpoint._consolidate_hf_safetensors import (
        consolidate_safetensors_files_on_every_rank,
    )

    torch.manual_seed(0)
    model = models.build("llama")
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    index = {k: 1 + i % 2 for i, k in enumerate(sorted(sd))}  # as the HF assets' index spreads them
    step = Path(tmp) / "checkpoint" / "step-5"
    if stage == "save":
        model.save_pretrained(Path(tmp) / "ref")
        model.config.save_pretrained(step.parent)  # the run's HF assets
        writer = HuggingFaceStorageWriter(
            path=str(step / "sharded"), save_distributed=True, fqn_to_index_mapping=index,
            enable_consolidation=False,
        )  # fmt: skip
        dcp.save(sd, storage_writer=writer)
    else:
        consolidate_safetensors_files_on_every_rank(str(step / "sharded"), str(step), index, num_threads=5)


def test_a_sharded_hf_save_is_published_once_consolidated_as_save_pretrained_writes_it(tmp_path):
    root, step = tmp_path / "checkpoint", tmp_path / "checkpoint" / "step-5"
    launch(titan_hf_save, str(tmp_path), "save", world=1, deadline_s=120)
    res = watch_once(root, tmp_path / "sink")  # saved, not yet consolidated
    assert res.returncode == 0 and not published(tmp_path / "sink", 5).exists(), res.stdout + res.stderr

    launch(titan_hf_save, str(tmp_path), "consolidate", world=1, deadline_s=120)
    assert json.loads((step / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(list(step.glob("model-*-of-00002.safetensors"))) == 2
    res = watch_once(root, tmp_path / "sink")
    assert "1 step(s) published, 0 not" in res.stdout + res.stderr, res.stdout + res.stderr
    out = published(tmp_path / "sink", 5)
    assert_same_tensors(out, tmp_path / "ref")
    assert not (out / "sharded").exists()
