"""Buffers the next forward updates in place (BatchNorm's running statistics) are saved as at `save()`."""

from __future__ import annotations

import threading

import pytest
import torch


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 4))


CUDA = pytest.param(
    "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA: bench/device_goodput.sh")
)


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("known", ["attach", "model", "neither"])
def test_buffers_the_next_forward_updates_are_saved_as_at_save(tmp_path, known, device):
    """The README's loop: save, then the next forward and backward run while the host copy does, and the
    wait comes before the optimizer step. BatchNorm's forward updates running_mean, running_var and
    num_batches_tracked in place (without bumping their versions), so a copy that reached them after
    that forward saved them one forward later than the parameters: a resume was not bit for bit. The
    copy thread is held until the forward is done, as a large tensor copied first holds it; every saved
    tensor must be the value at save(), whether the Stager knows the parameters from an attached
    optimizer, from `model=`, or not at all. On CUDA the snapshot is ordered before that forward by the
    compute stream."""
    from stagerd import Stager

    model = _model().to(device)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(6, 8, device=device)

    def forward_backward() -> None:
        model(x).pow(2).sum().backward()

    at_save: dict[int, dict[str, torch.Tensor]] = {}
    with Stager(tmp_path) as stager:
        if known == "attach":
            stager.attach(optim)
        for step in range(1, 4):
            forward_backward()
            if known != "attach":
                stager.wait_staged()
            optim.step()
            optim.zero_grad()
            gate = threading.Event()
            stager._copy_thread.submit(gate.wait)  # the copy starts only once the next forward ran
            stager.save(model.state_dict(), step, model=model if known == "model" else None)
            at_save[step] = {k: v.clone() for k, v in model.state_dict().items()}
            forward_backward()  # the next forward: updates the running statistics in place
            gate.set()
        stager.wait()
        for step, expected in at_save.items():
            got = {k: torch.zeros_like(v) for k, v in expected.items()}
            stager.load(got, step=step)
            for k, v in expected.items():
                assert torch.equal(got[k], v), f"step {step}: {k} is not its value at save()"
    assert not torch.equal(model[1].running_mean, at_save[3]["1.running_mean"])  # the forward did change it


def test_only_tensors_no_optimizer_step_owns_are_copied_before_save_returns():
    """The eager set: the model's buffers, never its parameters; without a model or an attached
    optimizer, the small tensors (a large one is taken for a parameter)."""
    from stagerd.training.eager import EAGER_MAX_BYTES, Owners

    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16))
    model.add_module("big", torch.nn.Linear(EAGER_MAX_BYTES // 4 + 1, 1, bias=False))
    sd = model.state_dict()
    buffers = {"1.running_mean", "1.running_var", "1.num_batches_tracked"}
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    assert set(Owners.of(model, []).eager(sd)) == buffers
    assert set(Owners.of(None, [optim]).eager(sd)) == buffers
    assert set(Owners.of(None, []).eager(sd)) == set(sd) - {"big.weight"}
