"""`ModelCheckpoint(monitor=..., save_top_k=...)` through `StagerdCheckpointIO`: the step `best_model_path`
points at, and each of a finite top k (`best_k_models`), is pinned against the daemon's retention, so
`stagerd watch --keep-last 1` keeps them beside the newest step, `trainer.test(ckpt_path="best")` after
`fit` loads the best and each top-k path loads its step; with `save_top_k=-1` the best alone is pinned.
One process, a real Lightning Trainer on CPU, a linear model, a logged score that makes step 2 the best of
4, and the real daemon. (DDP on 2 ranks, resuming: `test_lightning.py`.)"""

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
    from stagerd.integrations.lightning import load_from_checkpoint

    trainer, model, best, root, weights = fitted
    assert Path(best.best_model_path).name == "step=2.ckpt"
    assert sorted(p.name for p in Path(best.dirpath).iterdir()) == ["last.ckpt", "step=2.ckpt", "step=3.ckpt"]
    # read before test(ckpt_path="best"), which takes the callback's state at step 2 back
    assert sorted(best.best_k_models) == [str(Path(best.dirpath) / f"step={s}.ckpt") for s in (2, 3)]
    args = ["watch", root, "--sink", (tmp_path / "sink").as_uri(), "--once", "--keep-last", "1"]
    done = run_cli([*args, *fast_flags()])
    assert done.returncode == 0, done.stderr[-3000:]
    trainer.test(model, loader(), ckpt_path="best", verbose=False)
    assert model.tested.keys() == weights[2].keys()
    assert all(v.equal(weights[2][k]) for k, v in model.tested.items())
    assert not any(v.equal(weights[4][k]) for k, v in model.tested.items())
    assert "step 2: kept while a trainer pins it" in done.stderr
    assert "step 3: kept while a trainer pins it" in done.stderr
    assert [s for s, _ in layout.committed_steps(root)] == [2, 3, 4]  # the top 2, and the newest
    third = load_from_checkpoint(type(model), str(Path(best.dirpath) / "step=3.ckpt")).state_dict()
    assert all(v.equal(weights[3][k]) for k, v in third.items())


def test_the_pin_moves_with_the_best_and_holds_only_it(fitted):
    from stagerd.contract.step.pin import pinned

    trainer, model, best, root, weights = fitted
    assert PINS == {1: [], 2: [1], 3: [1, 2], 4: [2, 3]}  # the top 2 of the steps saved before
    assert pinned(root, 2) and pinned(root, 3) and not pinned(root, 4)
    ckpts = Path(best.dirpath)
    # as better scores at steps 3 and 4 would: step 2 leaves the top 2 (its file removed) and step 4 joins
    best.best_k_models = {
        str(ckpts / "step=3.ckpt"): torch.tensor(0.5),
        str(ckpts / "last.ckpt"): torch.tensor(0.7),
    }
    best.best_model_path = str(ckpts / "step=3.ckpt")
    model.load_state_dict(weights[4])  # step 4's, staged: not the best that test(ckpt_path=) loaded
    trainer.save_checkpoint(ckpts / "last.ckpt")
    assert pinned(root, 3) and pinned(root, 4) and not pinned(root, 2)


def test_a_resumed_fit_pins_the_best_it_recorded_before_its_first_save(fitted):
    """`last.ckpt` (step 4) recorded step 2 as the best and steps 2 and 3 as the top 2; the first run's
    plugin now pins steps 3 and 4 (the test above), and is told to let them go. A second trainer resumed from
    it saves nothing (already at `max_steps`), and still holds steps 2 and 3, as its `ModelCheckpoint` (of
    the same state key, a finite top k) names them again, until `release_pins()`."""
    from stagerd.contract.step.pin import pinned

    trainer, _, first, root, _ = fitted
    trainer.strategy.checkpoint_io.release_pins()
    assert not any(pinned(root, s) for s in SCORES)
    io = _resumed(first, root)
    assert [s for s in SCORES if pinned(root, s)] == [2, 3]
    io.release_pins()  # the run needs them no more: retention may have them
    assert not any(pinned(root, s) for s in SCORES)


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


def test_the_top_k_are_kept_after_the_process_ended(tmp_path):
    """`save_top_k=2`, steps 2 and 3 the best of 4: with the plugin let go (its pins with it, as at the
    process's end), `--keep-last 1` keeps them all the same, since the newest step records them
    (`extras/stagerd.best.json`, left out of the export), `status` shows them pinned, and `best_model_path`
    loads step 2, as a later process's `load_from_checkpoint(best_path)` would."""
    import gc

    from stagerd.cmd.status import collect
    from stagerd.contract import best_steps
    from stagerd.contract.step.pin import pinned
    from stagerd.integrations.lightning import load_from_checkpoint

    root, sink = tmp_path / "root", tmp_path / "sink"
    cls, at_2 = _fit(root, tmp_path / "ckpts", top_k=2)
    gc.collect()  # the trainer, its module and the plugin refer to each other
    assert not pinned(root, 2) and not pinned(root, 3)
    done = run_cli(["watch", root, "--sink", sink.as_uri(), "--once", "--keep-last", "1", *fast_flags()])
    assert done.returncode == 0, done.stderr[-3000:]
    assert [s for s, _ in layout.committed_steps(root)] == [2, 3, 4]
    assert "step 2: kept while the newest step names it best" in done.stderr
    status = collect(root, include_retired=False)
    assert {s["step"]: s["pinned"] for s in status["steps"]} == {2: True, 3: True, 4: False}
    assert (sink / layout.step_dir_name(4) / layout.MANIFEST_NAME).is_file()
    assert not (sink / layout.step_dir_name(4) / best_steps.NAME).exists()
    assert load_from_checkpoint(cls, at_2).layer.weight.shape == (2, 4)


def test_with_save_top_k_minus_1_the_best_alone_is_pinned_and_recorded(tmp_path):
    """`save_top_k=-1` keeps every checkpoint in Lightning's own bookkeeping: pinning or recording them all
    would make `--keep-last` keep every step, so the best alone is held, during the run and after it."""
    import gc

    from stagerd.contract.step.pin import pinned

    root = tmp_path / "root"
    _fit(root, tmp_path / "ckpts", top_k=-1, pins={2})
    gc.collect()
    done = run_cli(["watch", root, "--sink", (tmp_path / "sink").as_uri(), "--once", "--keep-last", "1",
                    *fast_flags()])  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert [s for s, _ in layout.committed_steps(root)] == [2, 4] and not pinned(root, 2)


def _fit(root: Path, dirpath: Path, *, top_k: int, pins: set[int] | None = None) -> tuple[type, str]:
    """A fit of 4 steps with `save_top_k=top_k` (and `last`, so every step is saved), its trainer and plugin
    let go: the module's class and the best path (step 2's), pinned until then with the rest of the top
    k (`pins`: the steps pinned then, by default steps 2 and 3)."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    from stagerd.contract.step.pin import pinned
    from stagerd.integrations.lightning import StagerdCheckpointIO

    best = ModelCheckpoint(dirpath=dirpath, monitor="score", mode="min", save_top_k=top_k, save_last=True,
                           every_n_train_steps=1, filename="{step}")  # fmt: skip
    trainer = pl.Trainer(max_steps=4, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[best],
                         plugins=[StagerdCheckpointIO(root)])  # fmt: skip
    model = module()
    trainer.fit(model, loader())
    assert Path(best.best_model_path).name == "step=2.ckpt"
    assert {s for s in SCORES if pinned(root, s)} == (pins if pins is not None else {2, 3})
    return type(model), best.best_model_path
