"""The README's own loop written with Accelerate (one CPU process): `stager.attach(optimizer)` takes the
optimizer `accelerator.prepare` returns, an `AcceleratedOptimizer` whose step runs no optimizer hooks,
and attaches the torch optimizer inside it; with gradient accumulation the wait comes before each real
update. A run resumed with `Stager.load` from a mid-run step goes on as the uninterrupted one, bit for
bit."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from stagerd import Stager
from stagerd.errors import ConfigError
from tests.fidelity import models

STEPS, SAVE_AT, ACCUMULATE = 4, 2, 2


def _loop(root: Path, seed: int, resume: bool) -> tuple[dict[int, float], dict[str, Any], list[bool]]:
    import transformers as tf
    from accelerate import Accelerator
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(models.config("llama"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=ACCUMULATE)
    model, optimizer = accelerator.prepare(model, optimizer)
    stager = Stager(root)
    stager.attach(optimizer)
    first = 1
    if resume:
        msd, osd = get_state_dict(model, optimizer.optimizer)
        first = stager.load(msd, osd) + 1
        set_state_dict(model, optimizer.optimizer, model_state_dict=msd, optim_state_dict=osd)
    ids = torch.randint(
        0, models.VOCAB, (STEPS * ACCUMULATE, 2, 12), generator=torch.Generator().manual_seed(1)
    )
    losses: dict[int, float] = {}
    attached: list[bool] = []
    for step in range(first, STEPS + 1):
        for micro in range(ACCUMULATE):
            batch = ids[(step - 1) * ACCUMULATE + micro]
            with accelerator.accumulate(model):
                loss = model(input_ids=batch, labels=batch).loss
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            losses[step] = loss.item()
        hooks = optimizer.optimizer._optimizer_step_pre_hooks.values()
        attached.append(any(h.__module__ == "stagerd.training.optimizer_hook" for h in hooks))
        if step == SAVE_AT:
            msd, osd = get_state_dict(model, optimizer.optimizer)
            stager.save(msd, step=step, optimizer_state=osd)
    stager.close()
    return losses, {k: v.clone() for k, v in model.state_dict().items()}, attached


def test_an_accelerate_loop_attaches_its_prepared_optimizer_and_resumes_bit_for_bit(tmp_path):
    full, full_weights, attached = _loop(tmp_path / "root", seed=0, resume=False)
    assert attached == [True] * STEPS
    resumed, resumed_weights, _ = _loop(tmp_path / "root", seed=1, resume=True)
    assert sorted(resumed) == list(range(SAVE_AT + 1, STEPS + 1))
    assert resumed == {s: full[s] for s in resumed}
    assert all(torch.equal(full_weights[k], resumed_weights[k]) for k in full_weights)


def test_an_optimizer_whose_step_runs_no_hooks_is_refused_by_name(tmp_path):
    class Wrapped(torch.optim.Optimizer):
        def __init__(self) -> None:  # as Accelerate's wrapper: no Optimizer.__init__, nothing inside
            self.param_groups: list[Any] = []

    stager = Stager(tmp_path / "root")
    try:
        with pytest.raises(ConfigError, match="cannot attach a Wrapped: its step runs no optimizer hooks"):
            stager.attach(Wrapped())
    finally:
        stager.close()
