"""`Stager.save(..., model=torch.compile(model))`: the export is what `save_pretrained` writes, whether the
state dict is `get_model_state_dict`'s (no `_orig_mod.` in its keys) or the compiled module's own (with
it). Before, the plan was traced on the wrapper, whose keys carry `_orig_mod.`, so a state dict without
it was dropped whole and the export held no weights. A `model=` that exports none of the saved tensors
is refused at save time."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from stagerd import Stager
from stagerd.contract import layout
from stagerd.engine.export import export_step
from stagerd.errors import HubPlanError
from tests.fidelity import harness
from tests.training.tiny_llama import tiny_llama


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("keys", ["get_model_state_dict", "state_dict"])
def test_a_compiled_model_exports_as_save_pretrained(tmp_path, tied, keys):
    model = tiny_llama(layers=2, tied=tied)
    compiled = torch.compile(model)  # compiles lazily: nothing runs until a forward
    sd = get_model_state_dict(compiled) if keys == "get_model_state_dict" else compiled.state_dict()
    assert any(k.startswith("_orig_mod.") for k in sd) == (keys == "state_dict")
    with Stager(tmp_path / "root") as stager:
        stager.save(sd, step=1, model=compiled)
        stager.wait()
    export = export_step(tmp_path / "root" / layout.step_dir_name(1), threads=1).export_dir
    model.save_pretrained(tmp_path / "ref")
    harness.assert_same_tensors(export, tmp_path / "ref")
    harness.assert_same_weight_files(export, tmp_path / "ref")


class _Wrapper(torch.nn.Module):
    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner


def test_a_model_whose_keys_none_of_the_saved_are_is_refused(tmp_path):
    model = tiny_llama(layers=2, tied=False)
    # the wrapper's transformers model sits under `inner.`, the saved keys are the bare model's
    with Stager(tmp_path / "root") as stager, pytest.raises(HubPlanError, match="exports none of the saved"):
        stager.save(model.state_dict(), step=1, model=_Wrapper(model))
    assert not (tmp_path / "root" / layout.step_dir_name(1)).exists()
