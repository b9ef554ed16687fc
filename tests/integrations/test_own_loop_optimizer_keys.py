"""Your own loop's resume: a step whose optimizer state was saved as `optimizer.state_dict()` (keyed by
parameter index) meets `Stager.load` with `get_state_dict`'s (keyed by name). The error says so and what
loads it, and what it says does load it, equal to the state saved (one process, real AdamW)."""

from __future__ import annotations

import pytest
import torch
from torch import nn


def _trained() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    return model, opt


def _fresh() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def test_an_index_keyed_optimizer_state_loaded_by_name_says_how_to_load_it(tmp_path):
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from stagerd import Stager
    from stagerd.errors import LoadError

    model, opt = _trained()
    with Stager(tmp_path) as stager:
        stager.save(model.state_dict(), 1, optimizer_state=opt.state_dict()).result()

    fresh, fresh_opt = _fresh()
    model_sd, optim_sd = get_state_dict(fresh, fresh_opt)
    with Stager(tmp_path) as stager, pytest.raises(LoadError) as e:
        stager.load(model_sd, optim_sd)
    text = str(e.value)
    assert "keyed by parameter index" in text and "'state.0." in text
    assert "load into optimizer.state_dict()" in text

    fresh, fresh_opt = _fresh()  # what the message says: get_state_dict, then the index-keyed dict
    get_state_dict(fresh, fresh_opt)
    osd = fresh_opt.state_dict()
    with Stager(tmp_path) as stager:
        assert stager.load(fresh.state_dict(), osd) == 1
    fresh_opt.load_state_dict(osd)
    want, got = opt.state_dict(), fresh_opt.state_dict()
    assert want["param_groups"] == got["param_groups"]
    for i, state in want["state"].items():
        for k, v in state.items():
            assert torch.equal(got["state"][i][k], v), (i, k)
    for a, b in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_fresh_optimizers_own_state_dict_still_gets_the_get_state_dict_hint(tmp_path):
    """Empty `state` (a fresh optimizer) is no key kind: the error names get_state_dict, as before."""
    from stagerd import Stager
    from stagerd.errors import LoadError

    model, opt = _trained()
    with Stager(tmp_path) as stager:
        stager.save(model.state_dict(), 1, optimizer_state=opt.state_dict()).result()
    fresh, fresh_opt = _fresh()
    with Stager(tmp_path) as stager, pytest.raises(LoadError, match=r"get_state_dict.*which creates it"):
        stager.load(fresh.state_dict(), fresh_opt.state_dict())
