"""`ModelCheckpoint(monitor=..., save_top_k=...)` through `StagerdCheckpointIO`: the step `best_model_path`
points at is pinned against the daemon's retention, so `stagerd watch --keep-last 1` keeps it beside the
newest step and `trainer.test(ckpt_path="best")` after `fit` loads it. One process, a real Lightning
Trainer on CPU, a linear model, a logged score that makes step 2 the best of 4, and the real daemon.
(DDP on 2 ranks, resuming: `test_lightning.py`.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from stagerd.contract import layout
from tests.cli_helpers import run_cli
from tests.daemon_helpers import fast_flags

pytestmark = pytest.mark.slow  # the daemon runs as a child process

SCORES = {1: 3.0, 2: 1.0, 3: 2.0, 4: 4.0}  # mode="min": step 2 is the best, then step 3 is second
PINS: dict[int, list[int]] = {}  # global step -> the steps pinned at its batch's end, before its save


def module() -> Any:
    import lightning.pytorch as pl

    class Linear(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.layer = torch.nn.Linear(4, 2)
            self.tested: dict[str, torch.Tensor] = {}

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            self.log("score", SCORES[self.global_step + 1])
            return self.layer(batch[0]).pow(2).mean()

        def test_step(self, batch: Any, batch_idx: int) -> None:
            self.tested = {k: v.clone() for k, v in self.state_dict().items()}

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return Linear()


def loader() -> Any:
    data = torch.utils.data.TensorDataset(torch.arange(16.0).reshape(4, 4) / 16)
    return torch.utils.data.DataLoader(data, batch_size=1)


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    """Four steps, each saved; the trainer, its `ModelCheckpoint`, ROOT, the weights at each step and the
    steps pinned before its save (`ModelCheckpoint` runs last: the steps before it are saved)."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    from stagerd.contract.step.pin import pinned
    from stagerd.integrations.lightning import StagerdCheckpointIO

    tmp = tmp_path_factory.mktemp("best")
    root, weights = tmp / "root", {}

    class Weights(pl.Callback):
        def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
            weights[trainer.global_step] = {k: v.clone() for k, v in pl_module.state_dict().items()}
            PINS[trainer.global_step] = [s for s in SCORES if pinned(root, s)]

    best = ModelCheckpoint(dirpath=tmp / "ckpts", monitor="score", mode="min", save_top_k=2,
                           save_last=True, every_n_train_steps=1, filename="{step}")  # fmt: skip
    trainer = pl.Trainer(max_steps=4, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[Weights(), best],
                         plugins=[StagerdCheckpointIO(root)])  # fmt: skip
    model = module()
    trainer.fit(model, loader())
    return trainer, model, best, root, weights


def test_the_best_step_survives_keep_last_1_and_loads_back_as_best(fitted, tmp_path):
    trainer, model, best, root, weights = fitted
    assert Path(best.best_model_path).name == "step=2.ckpt"
    assert sorted(p.name for p in Path(best.dirpath).iterdir()) == ["last.ckpt", "step=2.ckpt", "step=3.ckpt"]
    args = ["watch", root, "--sink", (tmp_path / "sink").as_uri(), "--once", "--keep-last", "1"]
    done = run_cli([*args, *fast_flags()])
    assert done.returncode == 0, done.stderr[-3000:]
    trainer.test(model, loader(), ckpt_path="best", verbose=False)
    assert model.tested.keys() == weights[2].keys()
    assert all(v.equal(weights[2][k]) for k, v in model.tested.items())
    assert not any(v.equal(weights[4][k]) for k, v in model.tested.items())
    assert "step 2: kept while a trainer pins it" in done.stderr
    assert [s for s, _ in layout.committed_steps(root)] == [2, 4]  # the best, and the newest (step 3 is
    # in the top 2, but only the best is pinned: save_top_k=-1 must not keep every step)


def test_the_pin_moves_with_the_best_and_holds_only_it(fitted):
    from stagerd.contract.step.pin import pinned

    trainer, model, best, root, weights = fitted
    assert PINS == {1: [], 2: [1], 3: [2], 4: [2]}  # step 1 the best, then ModelCheckpoint chose step 2
    assert pinned(root, 2) and not pinned(root, 3) and not pinned(root, 4)
    best.best_model_path = str(Path(best.dirpath) / "step=3.ckpt")  # as a better score at step 3 would
    model.load_state_dict(weights[4])  # step 4's, staged: not the best that test(ckpt_path=) loaded
    trainer.save_checkpoint(Path(best.dirpath) / "last.ckpt")
    assert pinned(root, 3) and not pinned(root, 2)


def test_a_resumed_fit_pins_the_best_it_recorded_before_its_first_save(fitted):
    """`last.ckpt` (step 4) recorded step 2 as the best; the first run's plugin now pins step 3 alone (the
    test above). A second trainer resumed from it saves nothing (already at `max_steps`), and still holds
    step 2, as its `ModelCheckpoint` names it again, until `release_pins()`."""
    from stagerd.contract.step.pin import pinned

    _, _, first, root, _ = fitted
    assert not pinned(root, 2)
    io = _resumed(first, root)
    assert pinned(root, 2)
    io.release_pins()  # the run needs its best no more: retention may have it
    assert not pinned(root, 2)


def test_a_plugin_let_go_lets_its_pins_go(fitted):
    """A sweep of trainers in one process: each finished trial's best is not held until the process ends."""
    import gc

    from stagerd.contract.step.pin import pinned

    _, _, first, root, _ = fitted
    io = _resumed(first, root)
    assert pinned(root, 2)
    del io
    gc.collect()  # the trainer, its module and the plugin refer to each other
    assert not pinned(root, 2)


def _resumed(first: Any, root: Path) -> Any:
    """A second trainer resumed from the first's `last.ckpt` (step 4, already `max_steps`: nothing saved);
    its plugin."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    from stagerd.integrations.lightning import StagerdCheckpointIO

    best = ModelCheckpoint(dirpath=first.dirpath, monitor="score", mode="min", every_n_train_steps=1)
    io = StagerdCheckpointIO(root)
    trainer = pl.Trainer(max_steps=4, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[best], plugins=[io])  # fmt: skip
    trainer.fit(module(), loader(), ckpt_path=Path(first.dirpath) / "last.ckpt")
    assert Path(best.best_model_path).name == "step=2.ckpt"
    return io


def test_the_best_step_is_kept_after_the_process_ended(tmp_path):
    """`save_top_k=1`, step 2 the best of 4: with the plugin let go (its pins with it, as at the process's
    end), `--keep-last 1` keeps step 2 all the same, since the newest step records it as the best
    (`extras/stagerd.best.json`, left out of the export), `status` shows it pinned, and `best_model_path`
    loads it, as a later process's `load_from_checkpoint(best_path)` would."""
    import gc

    from stagerd.cmd.status import collect
    from stagerd.contract import best_steps
    from stagerd.contract.step.pin import pinned
    from stagerd.integrations.lightning import load_from_checkpoint

    root, sink = tmp_path / "root", tmp_path / "sink"
    cls, at_2 = _fit_top_1(root, tmp_path / "ckpts")
    gc.collect()  # the trainer, its module and the plugin refer to each other
    assert not pinned(root, 2)
    done = run_cli(["watch", root, "--sink", sink.as_uri(), "--once", "--keep-last", "1", *fast_flags()])
    assert done.returncode == 0, done.stderr[-3000:]
    assert [s for s, _ in layout.committed_steps(root)] == [2, 4]
    assert "step 2: kept while the newest step names it best" in done.stderr
    status = collect(root, include_retired=False)
    assert {s["step"]: s["pinned"] for s in status["steps"]} == {2: True, 4: False}
    assert (sink / layout.step_dir_name(4) / layout.MANIFEST_NAME).is_file()
    assert not (sink / layout.step_dir_name(4) / best_steps.NAME).exists()
    assert load_from_checkpoint(cls, at_2).layer.weight.shape == (2, 4)


def _fit_top_1(root: Path, dirpath: Path) -> tuple[type, str]:
    """A fit of 4 steps with `save_top_k=1` (and `last`, so every step is saved), its trainer and plugin
    let go: the module's class and the best path (step 2's), pinned until then."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    from stagerd.contract.step.pin import pinned
    from stagerd.integrations.lightning import StagerdCheckpointIO

    best = ModelCheckpoint(dirpath=dirpath, monitor="score", mode="min", save_top_k=1, save_last=True,
                           every_n_train_steps=1, filename="{step}")  # fmt: skip
    trainer = pl.Trainer(max_steps=4, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[best],
                         plugins=[StagerdCheckpointIO(root)])  # fmt: skip
    model = module()
    trainer.fit(model, loader())
    assert Path(best.best_model_path).name == "step=2.ckpt" and pinned(root, 2)
    return type(model), best.best_model_path
