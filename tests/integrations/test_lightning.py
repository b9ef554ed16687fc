"""`StagerdCheckpointIO` in a real Lightning Trainer: DDP on 2 gloo ranks, `ModelCheckpoint` saving through
the Stager, `fit(ckpt_path=...)` resuming from a stagerd step (`lightning_ranks`).

- the resumed run's losses and final weights are the uninterrupted run's, bit for bit;
- `stagerd watch --once` exports and publishes every step, each what `save_pretrained` writes of the
  transformers model inside the LightningModule at that step;
- `load_checkpoint` gives back Lightning's whole checkpoint dict from JSON and tensors, no pickle.
"""

from __future__ import annotations

import json

import pytest
import torch

from stagerd.contract import layout
from stagerd.errors import LoadError
from tests.fidelity import harness
from tests.gloo import launch

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from tests.integrations import lightning_ranks

    out = tmp_path_factory.mktemp("lightning")
    launch(lightning_ranks.run, str(out), deadline_s=400)
    return out


def test_fit_from_a_stagerd_step_resumes_bit_for_bit(run):
    result = json.loads((run / "result.json").read_text())
    assert list(result["full"]) == ["1", "2", "3", "4"]
    assert result["resumed"] == {k: result["full"][k] for k in ("3", "4")}
    assert result["same_weights"]
    # After a save, the next step waits for its copy, after the closure (the resumed run saves only
    # after its last step)
    assert result["attached"] == [True, False]


def test_the_daemon_exports_every_step_as_save_pretrained(run):
    sink = run / "sink"
    harness.export(run / "full" / "root", sink)
    for step in (2, 4):
        published = sink / layout.step_dir_name(step)
        harness.assert_same_tensors(published, run / "ref" / f"step-{step}")
        assert json.loads((published / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]


def test_load_checkpoint_gives_back_lightnings_checkpoint(run):
    from stagerd.integrations.lightning import StagerdCheckpointIO

    io = StagerdCheckpointIO(run / "elsewhere")
    ckpt = io.load_checkpoint(run / "full" / "ckpts" / "last.ckpt")  # a pointer to step 4
    assert (ckpt["global_step"], ckpt["epoch"]) == (4, 1)
    assert ckpt["hyper_parameters"] == {"seed": 0, "lr": 1e-2}
    assert ckpt["loops"]["fit_loop"]["epoch_loop.batch_progress"]["total"]["completed"] == 4
    (opt,) = ckpt["optimizer_states"]
    assert isinstance(opt["param_groups"][0]["betas"], tuple)  # a tuple stays a tuple
    assert all(isinstance(k, int) for k in opt["state"])  # int keys stay ints
    assert torch.is_tensor(opt["state"][0]["exp_avg"])
    assert ckpt["lr_schedulers"][0]["last_epoch"] == 4
    assert any(k.startswith("ModelCheckpoint") for k in ckpt["callbacks"])
    sd = ckpt["state_dict"]
    assert sd["model.lm_head.weight"] is sd["model.model.embed_tokens.weight"]  # tied, staged once
    # ROOT itself names its newest step, a step directory names itself
    newest = io.load_checkpoint(run / "full" / "root")
    assert newest["global_step"] == 4
    assert io.load_checkpoint(run / "full" / "root" / layout.step_dir_name(2))["global_step"] == 2
    with pytest.raises(LoadError, match="not a stagerd checkpoint"):
        io.load_checkpoint(run / "full" / "ckpts")
