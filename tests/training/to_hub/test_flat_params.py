"""A model whose parameters are views into one flat buffer (a contiguous-parameters optimizer, FSDP1's or
ZeRO's flat buffers): save_pretrained clones each parameter that shares the buffer without overlapping
another, but a tied pair keeps it, and its splitter sizes that pair by the whole buffer. The export is
what save_pretrained writes, file for file. Before, the trace saw meta tensors of their own storages and
packed the tied embedding with its neighbours: one file fewer, every later tensor in another file."""

from __future__ import annotations

import json

import pytest
import torch

from stagerd import Stager
from stagerd.contract import layout
from stagerd.engine.export import export_step
from tests.fidelity import harness, models

LIMIT = 20_000  # a few tensors per file, so the sizes the splitter sees decide which file each lands in


def _flatten(model: torch.nn.Module) -> torch.Tensor:
    """Every parameter re-pointed into one buffer, in module order (a tied one once)."""
    params = list(model.parameters())
    flat = torch.empty(sum(p.numel() for p in params))
    at = 0
    for p in params:
        flat[at : at + p.numel()].copy_(p.detach().reshape(-1))
        p.data = flat[at : at + p.numel()].view_as(p)
        at += p.numel()
    return flat


@pytest.mark.parametrize("kind", ["llama_tied", "llama"])
def test_a_flat_buffer_model_exports_what_save_pretrained_writes(tmp_path, kind):
    torch.manual_seed(0)
    model = models.build(kind)
    flat = _flatten(model)
    with Stager(tmp_path / "root", checkpointer="thread") as stager:
        stager.save(model.state_dict(), step=1, model=model, extras={"config.json": model.config.to_dict()})
        stager.wait()
    export = export_step(tmp_path / "root" / layout.step_dir_name(1), max_shard_size=LIMIT).export_dir
    ref = tmp_path / "ref"
    model.save_pretrained(ref, max_shard_size=LIMIT)
    got, want = harness.weight_files(export), harness.weight_files(ref)
    assert sorted(got) == sorted(want)
    for name in want:
        if name != layout.INDEX_NAME:
            assert got[name] == want[name], f"{name}: bytes differ from save_pretrained's"
    # total_size: save_pretrained counts the tied pair's whole buffer; the engine counts the files' bytes
    index, ref_index = json.loads(got[layout.INDEX_NAME]), json.loads(want[layout.INDEX_NAME])
    assert index["weight_map"] == ref_index["weight_map"]
    assert index["metadata"]["total_parameters"] == ref_index["metadata"]["total_parameters"]
    if kind == "llama":
        assert got[layout.INDEX_NAME] == want[layout.INDEX_NAME]
    loaded = type(model).from_pretrained(export)
    for k, v in loaded.state_dict().items():
        assert torch.equal(v, model.state_dict()[k]), k
    assert flat.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # still the buffer's view
