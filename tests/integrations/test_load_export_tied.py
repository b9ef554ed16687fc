"""`Stager.load_export` of a tied transformers model: the export holds the tied weight once, as
`save_pretrained` writes it (no `lm_head.weight`), and the tied model's state dict, both keys, loads from
it. An untied export into a tied model loads only where the two tensors agree (one process, real
transformers Llama, real Stager and export engine)."""

from __future__ import annotations

import pytest
import torch

from stagerd.contract import layout
from stagerd.errors import LoadError
from tests.training.tiny_llama import tiny_llama, trained


def _export(root, model, step: int, dtype: str):
    from stagerd import Stager
    from stagerd.engine.export import export_step

    with Stager(root) as stager:
        stager.save(model.state_dict(), step, model=model).result()
    step_dir = root / layout.step_dir_name(step)
    export_step(step_dir, dtype=dtype)
    return step_dir / layout.EXPORT_DIR


@pytest.mark.parametrize("dtype", ["keep", "bf16"])
def test_a_tied_models_export_loads_into_a_tied_model(tmp_path, dtype):
    from safetensors.torch import load_file

    from stagerd import Stager

    model = trained(tiny_llama(tied=True))
    export = _export(tmp_path / "root", model, 1, dtype)
    held = load_file(export / "model.safetensors")
    assert "lm_head.weight" not in held and "model.embed_tokens.weight" in held  # as save_pretrained writes

    fresh = tiny_llama(tied=True)
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    sd = fresh.state_dict()
    with Stager(tmp_path / "other") as stager:
        stager.load_export(export, sd)
    for k, v in model.state_dict().items():
        want = v.to(torch.bfloat16).to(v.dtype) if dtype == "bf16" else v
        assert torch.equal(sd[k], want), k
    assert fresh.lm_head.weight.data_ptr() == fresh.model.embed_tokens.weight.data_ptr()


def test_an_untied_export_loads_into_a_tied_model_only_where_the_two_agree(tmp_path):
    from stagerd import Stager

    untied = trained(tiny_llama(tied=False))
    export = _export(tmp_path / "root", untied, 1, "keep")
    sd = tiny_llama(tied=True).state_dict()
    with Stager(tmp_path / "other") as stager, pytest.raises(LoadError, match="two different tensors"):
        stager.load_export(export, sd)
