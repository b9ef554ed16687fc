"""A model whose parameters are views into one flat buffer (a contiguous-parameters optimizer, FSDP1's or
ZeRO's flat buffers): save_pretrained clones each parameter that shares the buffer without overlapping
another, but a tied pair keeps it, and its splitter sizes that pair by the whole buffer, and counts it so in
the index's total_size. The export is what save_pretrained writes, file for file and index whole. Before,
the trace saw meta tensors of their own storages and packed the tied embedding with its neighbours: one file
fewer, every later tensor in another file; then the index's total_size counted the files' bytes.

Cast on export (`--dtype bf16`), the same model is what `model.to(torch.bfloat16).save_pretrained()` writes:
`.to()` gives each parameter a storage of its own, so the buffer's grouping no longer holds. Before, the
cast export still sized the tied pair by the buffer: 3 files against save_pretrained's 2."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from stagerd import Stager
from stagerd.contract import layout
from stagerd.engine.export import export_step
from stagerd.engine.verify import verify_export
from stagerd.errors import VerifyError
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


def _staged(tmp: Path, kind: str) -> tuple[torch.nn.Module, torch.Tensor, Path]:
    torch.manual_seed(0)
    model = models.build(kind)
    flat = _flatten(model)
    with Stager(tmp / "root", checkpointer="thread") as stager:
        stager.save(model.state_dict(), step=1, model=model, extras={"config.json": model.config.to_dict()})
        stager.wait()
    return model, flat, tmp / "root" / layout.step_dir_name(1)


def _assert_same_files(export: Path, ref: Path) -> None:
    got, want = harness.weight_files(export), harness.weight_files(ref)
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name] == want[name], f"{name}: bytes differ from save_pretrained's"


@pytest.mark.parametrize("kind", ["llama_tied", "llama"])
def test_a_flat_buffer_model_exports_what_save_pretrained_writes(tmp_path, kind):
    model, flat, step = _staged(tmp_path, kind)
    export = export_step(step, max_shard_size=LIMIT).export_dir
    ref = tmp_path / "ref"
    model.save_pretrained(ref, max_shard_size=LIMIT)
    _assert_same_files(export, ref)  # the index too: total_size counts the tied pair's whole buffer
    loaded = type(model).from_pretrained(export)
    for k, v in loaded.state_dict().items():
        assert torch.equal(v, model.state_dict()[k]), k
    assert flat.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # still the buffer's view
    # verify takes an index that counts a storage's bytes, alone or against the source
    verify_export(export)
    verify_export(export, step)


def test_a_flat_buffer_model_cast_on_export_is_what_its_cast_copy_writes(tmp_path):
    model, _, step = _staged(tmp_path, "llama_tied")
    export = export_step(step, dtype="BF16", max_shard_size=LIMIT).export_dir
    ref = tmp_path / "ref"
    copy.deepcopy(model).to(torch.bfloat16).save_pretrained(ref, max_shard_size=LIMIT)
    assert len(list(ref.glob("*.safetensors"))) == 2
    _assert_same_files(export, ref)
    verify_export(export, step)


def test_verify_refuses_a_total_size_neither_the_files_nor_the_source_give(tmp_path):
    """The index's total_size may exceed the files' bytes (a shared storage, counted whole), but not fall
    short of them, and against the source it is what the source's plan gives (or, from a stagerd before
    storages were counted, the files' bytes)."""
    _, _, step = _staged(tmp_path, "llama_tied")
    export = export_step(step, max_shard_size=LIMIT).export_dir
    index_path = export / layout.INDEX_NAME
    index = json.loads(index_path.read_text())
    total = index["metadata"]["total_size"]
    weights = [b for n, b in harness.weight_files(export).items() if n != layout.INDEX_NAME]
    data = sum(len(b) - 8 - int.from_bytes(b[:8], "little") for b in weights)
    assert total > data  # the tied pair's buffer, counted whole
    index["metadata"]["total_size"] = data  # as a stagerd before this wrote it: still a right export
    index_path.write_text(json.dumps(index))
    verify_export(export, step)
    for bad, alone in ((data - 8, True), (total + 4, False), (total - 4, False)):
        index["metadata"]["total_size"] = bad
        index_path.write_text(json.dumps(index))
        if alone:
            with pytest.raises(VerifyError, match="total_size"):
                verify_export(export)
        else:
            verify_export(export)  # alone, a total over the files' bytes may be a storage's
        with pytest.raises(VerifyError, match="total_size"):
            verify_export(export, step)
