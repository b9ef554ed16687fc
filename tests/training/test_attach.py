"""`Stager.attach(optimizer)`: the step waits for the host copy; the first save allocates nothing."""

from __future__ import annotations

import torch

from stagerd.contract import commit_marker, layout


def test_attached_optimizer_waits_for_the_copy_and_buffers_are_reserved(tmp_path):
    from stagerd import Stager

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)

    def step() -> None:
        model(torch.randn(3, 8)).pow(2).sum().backward()
        optim.step()
        optim.zero_grad()

    with Stager(tmp_path) as stager:
        hook = stager.attach(optim)
        step()  # the first step: the post-hook reserves every parameter's and state's buffer
        stager.reserve({}, wait=True)  # waits for the reservation the first step started
        reserved = stager.staging_buffers()
        at_save = {k: v.clone() for k, v in model.state_dict().items()}
        stager.save(model.state_dict(), 1, optimizer_state=optim.state_dict())
        step()  # changes every parameter: only once the copy is done (the pre-hook waits)
        step()
        assert stager.staging_buffers() == reserved, "the first save allocated buffers of its own"
        assert len(reserved) == 4 + 4 * 3  # weights and biases; exp_avg, exp_avg_sq, step of each
        marker = stager.wait()[0]
        commit_marker.check_staged_files(tmp_path / layout.step_dir_name(1), marker)
        got = {k: torch.zeros_like(v) for k, v in at_save.items()}
        stager.load(got)
        hook.remove()
    for k, v in at_save.items():
        assert torch.equal(got[k], v), k
        assert not torch.equal(model.state_dict()[k], v), k  # the steps after the save did change it


def test_the_wait_comes_after_the_steps_closure_and_before_the_update(tmp_path):
    """A step given a closure (Lightning runs forward and backward in it) waits after the closure, under
    which the copy ran, and before the update; a step without one waits at once."""
    from stagerd import Stager

    log: list[str] = []
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=1.0)

    def closure() -> torch.Tensor:
        log.append(f"closure {p.tolist()}")  # forward and backward
        p.grad = torch.ones(2)
        return torch.tensor(0.0)

    with Stager(tmp_path) as stager:
        real = stager.wait_staged

        def wait_staged(timeout: float | None = None) -> None:
            real(timeout)
            log.append(f"copied {(h := stager._saves.latest) is not None and h.staged()}")

        stager.wait_staged = wait_staged  # type: ignore[method-assign]
        assert stager.attach(opt) is stager.attach(opt)  # attached once
        stager.save({"p": p}, 1)
        opt.step(closure)
        log.append(f"updated {p.tolist()}")
        opt.step(closure=closure)  # Lightning's way: a keyword
        log.append(f"updated {p.tolist()}")
        opt.step()
        stager.wait()
        saved = {"p": torch.zeros(2)}
        stager.load(saved)
    assert log == [
        *["closure [1.0, 1.0]", "copied True", "updated [0.0, 0.0]"],
        *["closure [0.0, 0.0]", "copied True", "updated [-1.0, -1.0]"],
        "copied True",  # no closure: at once
    ]
    assert torch.equal(saved["p"], torch.ones(2))


def test_a_save_without_optimizer_state_keeps_no_optimizer_buffers(tmp_path):
    """`attach` reserves the optimizer state's host buffers after the first step (twice the model for
    Adam; page-locked with CUDA). A loop that saves the model alone (the Trainer's `save_only_model`)
    kept them for the whole run; now the first save without `optimizer_state` frees them."""
    from stagerd import Stager

    model = torch.nn.Linear(64, 64)
    optim = torch.optim.AdamW(model.parameters())
    with Stager(tmp_path) as stager:
        stager.attach(optim)
        model(torch.randn(2, 64)).sum().backward()
        optim.step()
        stager.reserve({}, wait=True)
        model_bytes = sum(p.untyped_storage().nbytes() for p in model.parameters())
        assert sum(stager.staging_buffers().values()) > 2 * model_bytes  # model and Adam's moments
        stager.save(model.state_dict(), 1).result()
        assert sum(stager.staging_buffers().values()) == model_bytes
        stager.save(model.state_dict(), 2, optimizer_state=optim.state_dict()).result()
        assert sum(stager.staging_buffers().values()) > 2 * model_bytes  # a full save still stages it
