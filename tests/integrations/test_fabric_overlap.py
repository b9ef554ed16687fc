"""A `fabric.save` returns before its host copy is done, the next `optimizer.step()` waiting for it, as under
the Trainer: a loop that saves, trains on, and loads the saved step gets the values of `fabric.save`'s
time bit for bit, BatchNorm's running statistics (updated by the forward that runs while the copy is held
back) included. Where no step is known to come first (no optimizer in the state, a large buffer the Stager
would copy in the background), the save waits for its copy itself.

The Stager's copy thread is held back by a gate from before the save until something waits for the copy,
so a save that returns has returned before its copy, whatever the machine's speed; a wait releases the
gate, so a save that waits does not hang."""

from __future__ import annotations

import threading

import pytest
import torch

from stagerd.training.eager import EAGER_MAX_BYTES

pytestmark = pytest.mark.slow

SMALL, LARGE = 8, EAGER_MAX_BYTES // 4 + 1  # BatchNorm channels: its fp32 statistics copied now / later


def _net(channels: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(4, channels), torch.nn.BatchNorm1d(channels), torch.nn.Linear(channels, 1)
    )


def _snapshot(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, torch.Tensor]:
    out = {f"model/{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for i, s in (optimizer.state_dict()["state"] if optimizer is not None else {}).items():
        out |= {f"optim/{i}/{k}": torch.as_tensor(v).clone() for k, v in s.items()}
    return out


@pytest.mark.parametrize(
    ("channels", "model_given", "with_optimizer", "waits_in_save"),
    [
        (SMALL, False, True, False),
        (SMALL, True, True, False),
        (LARGE, True, True, False),  # model=: its buffers are copied before the save returns
        (LARGE, False, True, True),  # a large buffer no model= names: copied later, a forward may change it
        (SMALL, True, False, True),  # no optimizer in the state: no step is known to wait
    ],
)
def test_a_fabric_save_returns_before_its_copy_and_the_next_step_waits_for_it(
    tmp_path, channels, model_given, with_optimizer, waits_in_save
):
    from lightning.fabric import Fabric

    from stagerd.integrations.lightning import StagerdCheckpointIO

    net = _net(channels)
    io = StagerdCheckpointIO(tmp_path / "root", model=net if model_given else None)
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[io])
    model, optimizer = fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=0.1))
    batches = torch.randn(6, 4, 4, generator=torch.Generator().manual_seed(1))

    def train(i: int) -> None:
        fabric.backward(model(batches[i]).pow(2).mean())
        optimizer.step()
        optimizer.zero_grad()

    state = {"model": model, "step": 0} | ({"optimizer": optimizer} if with_optimizer else {})
    train(0)
    state["step"] = 1
    fabric.save(tmp_path / "1.ckpt", state)  # makes the Stager
    stager = io.stager
    assert stager is not None
    stager.wait()
    train(1)
    state["step"] = 2

    log: list[str] = []
    gate = threading.Event()
    real = stager.wait_staged

    def wait_staged(timeout: float | None = None) -> None:
        pending = (h := stager._saves.latest) is not None and not h.staged()
        log.append(f"wait{' (copy pending)' if pending else ''}")
        gate.set()
        real(timeout)

    stager.wait_staged = wait_staged  # type: ignore[method-assign]
    stager._copy_thread.submit(gate.wait)  # the next save's copy runs only once something waits for it
    at_save = _snapshot(net, optimizer if with_optimizer else None)
    fabric.save(tmp_path / "2.ckpt", state)
    if waits_in_save:
        assert log == ["wait (copy pending)"]
    else:
        latest = stager._saves.latest
        assert log == [] and latest is not None and not latest.staged()  # returned before its copy
        hooks = optimizer.optimizer._optimizer_step_pre_hooks.values()
        assert any(h.__module__ == "stagerd.training.optimizer_hook" for h in hooks)
    train(2)  # the forward updates BatchNorm's statistics in place while the copy is held back
    assert log == ["wait (copy pending)"]  # the step waited (or the save did)
    train(3)
    io.teardown()
    assert not torch.equal(net[0].weight, at_save["model/0.weight"])  # the steps after the save changed it
    assert not torch.equal(net[1].running_mean, at_save["model/1.running_mean"])

    fresh = _net(channels)
    io2 = StagerdCheckpointIO(tmp_path / "root")
    fabric2 = Fabric(accelerator="cpu", devices=1, plugins=[io2])
    model2, optimizer2 = fabric2.setup(fresh, torch.optim.AdamW(fresh.parameters(), lr=0.1))
    loaded = {"model": model2, "step": 0} | ({"optimizer": optimizer2} if with_optimizer else {})
    fabric2.load(tmp_path / "2.ckpt", loaded)
    got = _snapshot(fresh, optimizer2 if with_optimizer else None)
    io2.teardown()
    assert loaded["step"] == 2 and sorted(got) == sorted(at_save)
    if with_optimizer:
        assert any(k.startswith("optim/") for k in got)
    for k, v in at_save.items():
        assert v.dtype == got[k].dtype and torch.equal(v, got[k]), k
