"""A model whose checkpoint fuses what memory keeps apart (transformers' `Chunk` on load, so a
concatenation on save) and stores a weight transposed (`Transpose`): the parts are planned as one output,
the transpose by source lines, and the export is what `save_pretrained` writes (one process: the
conversion is the same under FSDP2)."""

from __future__ import annotations

import pytest
import torch

from stagerd import Stager
from stagerd.contract import layout
from stagerd.engine.export import export_step
from tests.fidelity import harness, models


@pytest.mark.slow
def test_a_concatenating_conversion_exports_what_save_pretrained_writes(tmp_path):
    from transformers.core_model_loading import Chunk, Transpose, WeightConverter

    torch.manual_seed(0)
    model = models.build("llama")
    qkv = ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"]
    model._weight_conversions = [
        WeightConverter("self_attn.qkv_proj.weight", qkv, operations=[Chunk(dim=0)]),
        WeightConverter("mlp.down_weight_t", "mlp.down_proj.weight", operations=[Transpose(0, 1)]),
    ]
    with Stager(tmp_path / "root", checkpointer="thread") as stager:
        stager.save(model.state_dict(), step=1, model=model, extras={"config.json": model.config.to_dict()})
        stager.wait()
    step = tmp_path / "root" / layout.step_dir_name(1)
    for dtype in ("keep", "bf16"):
        export_dir = export_step(step, dtype=dtype).export_dir
        ref = tmp_path / f"ref-{dtype}"
        (model if dtype == "keep" else model.to(torch.bfloat16)).save_pretrained(ref)
        harness.assert_same_tensors(export_dir, ref)
        got = harness.tensors(export_dir)
        assert "model.layers.1.self_attn.qkv_proj.weight" in got and got["model.layers.1.mlp.down_weight_t"][
            1
        ] == (48, 32)
