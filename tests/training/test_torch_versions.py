"""What changed between torch releases must not break a save: torch 2.11's stager closing after each save.

In torch 2.11, `DefaultStager._stage` calls `StateDictStager.close()` after every save; that clears the
stager's deepcopy dispatch table and the next save of a nested dict fails (`KeyError: <class 'type'>`),
on torch's own `dcp.async_save` path too. The test makes the installed torch behave so (whatever its
version), shows torch's stager failing, then saves a nested optimizer state three times through the
Stager with that behaviour still in place and loads every step back.
"""

from __future__ import annotations

import functools

import pytest
import torch

from stagerd.contract import commit_marker, layout

# On a GPU machine the same test runs the CUDA path: page-locked buffers, side-stream copies.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _nested_optimizer_state(scale: float) -> dict:
    return {
        "state": {
            "w": {"exp_avg": torch.full((4, 3), scale, device=DEVICE),
                  "exp_avg_sq": torch.full((4, 3), scale**2, device=DEVICE), "step": torch.tensor(scale)},
            "b": {"exp_avg": torch.full((3,), -scale, device=DEVICE), "step": torch.tensor(scale)},
        },
        "param_groups": [{"lr": 0.01 * scale, "betas": (0.9, 0.95), "eps": 1e-8, "params": ["w", "b"]}],
    }  # fmt: skip


@pytest.fixture
def closing_after_every_save(monkeypatch):
    """Make torch's StateDictStager close itself after every stage(), as torch 2.11's DefaultStager does."""
    from torch.distributed.checkpoint._state_dict_stager import StateDictStager

    original = StateDictStager.stage

    @functools.wraps(original)
    def stage_then_close(self, *args, **kwargs):
        try:
            return original(self, *args, **kwargs)
        finally:
            self.close()

    monkeypatch.setattr(StateDictStager, "stage", stage_then_close)


def test_torch_stager_closing_after_every_save_fails_the_second_save(closing_after_every_save):
    """The failure mode itself, on the installed torch: the test below would catch a Stager that used it."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    stager = DefaultStager(
        StagingOptions(
            use_pinned_memory=False,
            use_shared_memory=False,
            use_async_staging=False,
            use_non_blocking_copy=False,
        )
    )
    stager.stage(_nested_optimizer_state(1.0))
    try:
        stager.stage(_nested_optimizer_state(2.0))
    except KeyError as e:
        assert "type" in str(e)
    else:  # torch 2.9 and 2.10: close() only drops the cached storages
        pytest.skip(f"torch {torch.__version__}'s StateDictStager.close() leaves it usable: nothing to show")
    finally:
        stager.close()


def test_nested_optimizer_state_saves_three_times_and_loads(tmp_path, closing_after_every_save):
    from stagerd import Stager

    model = {"w": torch.randn(4, 3, device=DEVICE), "b": torch.randn(3, device=DEVICE)}
    optim = _nested_optimizer_state(1.0)
    with Stager(tmp_path) as stager:
        for step in (1, 2, 3):
            with torch.no_grad():
                for t in (*model.values(), *optim["state"]["w"].values(), *optim["state"]["b"].values()):
                    t.add_(1.0)
            optim["param_groups"][0]["lr"] = 0.01 * step
            stager.save(model, step, optimizer_state=optim)
            stager.wait_staged()
        assert [m.step for m in stager.wait()] == [1, 2, 3]
        for step in (1, 2, 3):
            commit_marker.check_staged_files(tmp_path / layout.step_dir_name(step), commit_marker.read_marker(
                tmp_path / layout.step_dir_name(step)))  # fmt: skip
        got_model = {k: torch.zeros_like(v) for k, v in model.items()}
        got_optim = _nested_optimizer_state(0.0)
        assert stager.load(got_model, got_optim) == 3
    for k, v in model.items():
        assert torch.equal(got_model[k], v), k
    for p in ("w", "b"):
        for k, v in optim["state"][p].items():
            assert torch.equal(got_optim["state"][p][k], v), (p, k)
    assert got_optim["param_groups"] == optim["param_groups"]
    assert isinstance(got_optim["param_groups"][0]["betas"], tuple)
