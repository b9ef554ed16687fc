"""The pieces under the integrations, in one process: the JSON-and-tensors form of a trainer's state,
and the Trainer's state saved and loaded through a step. (The wait before the next optimizer step, after
a closure: `tests/training/test_attach.py`.)"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from stagerd import Stager
from stagerd.errors import LoadError, SaveInputError
from stagerd.integrations import hf_trainer, rng, state_tree


def test_a_trainers_state_comes_back_as_it_was():
    t = torch.arange(6.0).reshape(2, 3)
    tree = {
        "state": {0: {"step": torch.tensor(3.0), "exp_avg": t}, 1: {}},
        "param_groups": [{"lr": 0.1, "betas": (0.9, 0.999), "params": [0, 1], "fused": None}],
        "scores": {"nan": math.nan, "inf": -math.inf, "flag": True, "name": "x"},
        "dtype": torch.bfloat16,
        "odd": {"__stagerd__": "not a tag", "k": [1, (2, 3)]},
    }
    tensors, skeleton = state_tree.split(tree, "optimizer")
    assert set(tensors) == {"optimizer/state/0/step", "optimizer/state/0/exp_avg"}
    blob = state_tree.from_blob(state_tree.to_blob(skeleton), "test")  # through JSON bytes
    back = state_tree.join(blob, tensors.__getitem__)
    assert back["state"][0]["exp_avg"] is t and list(back["state"]) == [0, 1]
    assert back["param_groups"] == tree["param_groups"]
    assert isinstance(back["param_groups"][0]["betas"], tuple)
    assert math.isnan(back["scores"].pop("nan"))
    assert back["scores"] == {"inf": -math.inf, "flag": True, "name": "x"}
    assert back["dtype"] is torch.bfloat16 and back["odd"] == tree["odd"]
    specs = state_tree.tensor_specs(blob)
    assert specs["optimizer/state/0/exp_avg"] == (torch.float32, (2, 3))


def test_a_value_json_cannot_hold_is_refused_at_save_time_naming_it():
    with pytest.raises(SaveInputError, match=r"lightning/hyper_parameters/path: a pathlib.*PosixPath"):
        from pathlib import Path

        state_tree.split({"hyper_parameters": {"path": Path("/x")}}, "lightning")


def test_a_malformed_skeleton_is_a_load_error():
    with pytest.raises(LoadError, match="unknown __stagerd__ kind"):
        state_tree.join({"__stagerd__": "pickle"}, lambda k: torch.zeros(1))
    with pytest.raises(LoadError, match="unknown dtype"):
        state_tree.join({"__stagerd__": "dtype", "name": "Tensor"}, lambda k: torch.zeros(1))


def _trainer(seed: int, steps: int) -> SimpleNamespace:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for _ in range(steps):
        model(torch.randn(3, 4)).sum().backward()
        opt.step(), sched.step(), opt.zero_grad()
    return SimpleNamespace(model=model, optimizer=opt, lr_scheduler=sched, accelerator=None)


def test_the_trainers_state_comes_back_from_a_step(tmp_path):
    """Model, optimizer, scheduler and RNG, as `StagerdCallback` saves and loads them (in one process)."""
    saved, other = _trainer(0, 2), _trainer(1, 1)
    rng_at_save = rng.capture(0)
    with Stager(tmp_path) as stager:
        captured = hf_trainer.Captured(optimizer=True, rng=rng_at_save)
        msd, optim = hf_trainer.state_to_save(saved, captured, 0)
        stager.save(msd, step=2, optimizer_state=optim).result()
        torch.rand(5)  # the generators move on
        restored = hf_trainer.load(other, stager, 2)
    for a, b in zip(saved.model.state_dict().values(), other.model.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    for name, a in saved.optimizer.state_dict()["state"].items():
        b = other.optimizer.state_dict()["state"][name]
        assert all(torch.equal(a[k], b[k]) for k in a), name
    assert other.optimizer.param_groups[0]["lr"] == saved.optimizer.param_groups[0]["lr"] == 0.025
    assert other.lr_scheduler.state_dict() == saved.lr_scheduler.state_dict()
    rng.restore(0, restored.rng)
    assert torch.equal(torch.get_rng_state(), rng_at_save["rng/rank0/torch"])


def test_a_step_without_the_trainers_state_is_refused(tmp_path):
    with Stager(tmp_path) as stager:
        stager.save({"w": torch.ones(2)}, step=1, optimizer_state={"lr": 0.1, "t": torch.ones(1)}).result()
        with pytest.raises(LoadError, match="not a step StagerdCallback saved"):
            hf_trainer.load(_trainer(0, 0), stager, 1)
