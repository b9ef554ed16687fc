"""The to-Hub plan a save gets is resolved once per model and reused by its later saves: never by another
model, even one that took a freed model's place in memory (and so its `id`) with the same tensors."""

from __future__ import annotations

import torch

from stagerd import Stager
from stagerd.contract import commit_marker, layout
from tests.fidelity import models


class Holder(torch.nn.Module):
    """A wrapper around a transformers model: its export is that model's, found under `lm.`."""

    def __init__(self, lm: torch.nn.Module) -> None:
        super().__init__()
        self.lm = lm


class Plain(torch.nn.Module):
    """No transformers model inside: every key is exported under its own name."""


def test_a_new_model_in_a_freed_models_place_gets_its_own_plan(tmp_path):
    lm = models.build("llama_tied")
    sd = {f"lm.{k}": v for k, v in lm.state_dict().items()}
    plain = None
    with Stager(tmp_path) as stager:
        for step in range(1, 10):  # until the allocator hands the freed wrapper's memory to a new model
            holder = Holder(lm)
            stager.save(sd, step=step, model=holder).result()
            freed = id(holder)
            del holder  # freed at once: no cycle holds it
            plains = [Plain() for _ in range(256)]
            plain = next((p for p in plains if id(p) == freed), None)
            if plain is not None:
                break
        assert plain is not None, "the allocator never reused the freed model's memory"
        marker = stager.save(sd, step=100, model=plain).result()
    before = commit_marker.read_marker(tmp_path / layout.step_dir_name(step)).hub_plan
    assert before is not None and marker.hub_plan is not None
    assert "lm.model.embed_tokens.weight" not in {v.name for v in before.views}  # the wrapper's: lm. off
    assert "lm.model.embed_tokens.weight" in {v.name for v in marker.hub_plan.views}  # every key as is
