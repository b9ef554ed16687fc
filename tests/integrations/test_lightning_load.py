"""`load_from_checkpoint(cls, path)`: Lightning's `cls.load_from_checkpoint` for a path `StagerdCheckpointIO`
wrote, ROOT or ROOT/step-N. One process, real Lightning Trainers on CPU: the same training run once with
Lightning's own `.ckpt` files and once through the plugin; what Lightning's classmethod builds from its own
file and what ours builds from the staged step must be the same: class, hyper-parameters (an OmegaConf
config among them, unresolved), weights bit for bit with their dtypes and devices, tied weights still tied,
what `on_load_checkpoint` saw; a LightningDataModule's hyper-parameters and state too."""

from __future__ import annotations

import gc
import json
import shutil
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from omegaconf import DictConfig, ListConfig, OmegaConf

from stagerd.contract import layout
from stagerd.errors import LoadError
from stagerd.integrations.lightning import StagerdCheckpointIO, load_from_checkpoint
from stagerd.integrations.lightning_load import _location, _placed, read


class Tied(pl.LightningModule):
    def __init__(self, cfg: DictConfig, width: int = 4, scale: float = 0.5) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.a = torch.nn.Linear(width, width)
        self.b = torch.nn.Linear(width, width, bias=False)
        self.b.weight = self.a.weight  # tied: staged once
        self.register_buffer("calls", torch.zeros(2, dtype=torch.int64))
        self.register_buffer("gain", torch.full((2,), 0.3, dtype=torch.bfloat16))
        self.seen: list[str] = []

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        self.calls += 1
        loss = self.b(self.a(batch[0])).pow(2).mean() * self.hparams.scale * self.gain.float().sum()
        self.log("loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=self.hparams.cfg.lr)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.seen = [*sorted(checkpoint), f"scale={checkpoint['hyper_parameters'].get('scale')}"]


class Data(pl.LightningDataModule):
    def __init__(self, batch_size: int = 2, name: str = "ramp") -> None:
        super().__init__()
        self.save_hyperparameters()
        self.served = 0

    def train_dataloader(self) -> Any:
        self.served += 1
        data = torch.utils.data.TensorDataset(torch.arange(32.0).reshape(8, 4) / 32)
        return torch.utils.data.DataLoader(data, batch_size=self.hparams.batch_size)

    def state_dict(self) -> dict[str, Any]:
        return {"served": self.served}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.served = state_dict["served"]


def _config() -> DictConfig:
    return OmegaConf.create({"lr": 0.1, "tags": ["tiny", "${lr}"]})


def _fit(out: Path, staged: bool) -> str:
    """The best path (`best_model_path`) of a 4-step run; a checkpoint every 2 steps, all kept."""
    torch.manual_seed(0)
    module = Tied(_config())
    plugins = [StagerdCheckpointIO(out / "root", model=module)] if staged else []
    saves = ModelCheckpoint(dirpath=out / "ckpts", monitor="loss", every_n_train_steps=2, filename="{step}",
                            save_top_k=-1, save_last=True)  # fmt: skip
    trainer = pl.Trainer(max_steps=4, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, plugins=plugins, callbacks=[saves])  # fmt: skip
    trainer.fit(module, datamodule=Data(), weights_only=None if staged else False)
    return saves.best_model_path


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[Path, str]]:
    out = {}
    for name in ("own", "staged"):
        path = tmp_path_factory.mktemp(name)
        out[name] = path, _fit(path, staged=name == "staged")
    gc.collect()  # the staged run's trainer and Stager let go: a loading process of its own
    return out


def _assert_same_module(got: Any, want: Any) -> None:
    assert type(got) is type(want)
    assert dict(got.hparams).keys() == dict(want.hparams).keys()
    for k, v in want.hparams.items():
        assert type(got.hparams[k]) is type(v), k
        if isinstance(v, DictConfig | ListConfig):
            assert OmegaConf.to_container(got.hparams[k], resolve=False) == OmegaConf.to_container(v)
        else:
            assert got.hparams[k] == v, k
    mine, theirs = got.state_dict(), want.state_dict()
    assert list(mine) == list(theirs)
    for k, v in theirs.items():
        assert (mine[k].dtype, mine[k].device) == (v.dtype, v.device), k
        assert torch.equal(mine[k].view(torch.uint8), v.view(torch.uint8)), k
    assert got.b.weight is got.a.weight
    assert got.seen == want.seen and got.seen
    assert got.training == want.training


def test_the_best_path_builds_what_lightnings_own_builds(runs):
    own_best, best = runs["own"][1], runs["staged"][1]
    assert Path(best).name == Path(own_best).name
    got = load_from_checkpoint(Tied, best)
    want = Tied.load_from_checkpoint(own_best, weights_only=False)
    _assert_same_module(got, want)
    assert OmegaConf.to_container(got.hparams.cfg, resolve=False)["tags"] == ["tiny", "${lr}"]


@pytest.mark.parametrize("where", ["last", "root", "step-2"])
def test_root_and_a_step_directory_load_as_the_files_of_their_step(runs, where):
    own_dir, staged_dir = runs["own"][0], runs["staged"][0]
    path, own = {
        "last": (staged_dir / "ckpts" / "last.ckpt", "last.ckpt"),
        "root": (staged_dir / "root", "step=4.ckpt"),  # its newest committed step
        "step-2": (staged_dir / "root" / layout.step_dir_name(2), "step=2.ckpt"),
    }[where]
    got = load_from_checkpoint(Tied, path)
    _assert_same_module(got, Tied.load_from_checkpoint(own_dir / "ckpts" / own, weights_only=False))


def test_overrides_an_hparams_file_and_map_location_as_lightnings(runs, tmp_path):
    hparams = tmp_path / "hparams.yaml"
    hparams.write_text("cfg:\n  lr: 0.5\n  tags: [other]\nwidth: 4\n")
    options = {"map_location": "cpu", "hparams_file": hparams, "strict": True, "scale": 2.0}
    got = load_from_checkpoint(Tied, runs["staged"][1], **options)
    want = Tied.load_from_checkpoint(runs["own"][1], weights_only=False, **options)
    _assert_same_module(got, want)
    assert got.hparams.scale == 2.0 and got.hparams.cfg["lr"] == 0.5


def test_a_datamodule_loads_as_lightnings_own(runs):
    got = load_from_checkpoint(Data, runs["staged"][1], batch_size=3)
    want = Data.load_from_checkpoint(runs["own"][1], weights_only=False, batch_size=3)
    assert dict(got.hparams) == dict(want.hparams) == {"batch_size": 3, "name": "ramp"}
    assert got.served == want.served == 1


def test_lightnings_own_file_and_other_classes_are_refused_by_name(runs):
    with pytest.raises(LoadError, match="not a stagerd checkpoint") as e:
        load_from_checkpoint(Tied, runs["own"][1])
    assert "cls.load_from_checkpoint" in e.value.hint
    with pytest.raises(TypeError, match="LightningModule or LightningDataModule"):
        load_from_checkpoint(torch.nn.Linear, runs["staged"][1])  # type: ignore[type-var]


def test_a_path_whose_step_retention_deleted_says_so_and_how_to_restore(runs, tmp_path):
    # ModelCheckpoint keeps its file for a step the daemon's --keep-last deleted: a ROOT with step 4 only
    staged = runs["staged"][0]
    root = tmp_path / "root"
    shutil.copytree(staged / "root" / layout.step_dir_name(4), root / layout.step_dir_name(4))
    pointer = json.loads((staged / "ckpts" / "step=2.ckpt").read_text())
    path = tmp_path / "step=2.ckpt"
    path.write_text(json.dumps({**pointer, "root": str(root)}))
    with pytest.raises(LoadError, match=r"names step 2 of .*not committed there; its committed steps") as e:
        load_from_checkpoint(Tied, path)
    assert "newest first: 4" in str(e.value)
    assert f"stagerd restore URL {root} --step 2" in e.value.hint


def test_tensors_go_where_torch_load_puts_those_of_their_device(runs):
    """No accelerator here: the mapping is checked as torch.load's rules give it, and applied on `meta`."""
    checkpoint, saved_on = read(Path(runs["staged"][1]))
    assert saved_on == "cpu"
    if not torch.cuda.is_available():
        from lightning.pytorch.core.saving import _default_map_location

        assert _location("cuda:1", _default_map_location) == "cpu"  # as Lightning's file loads here
    assert _location("cuda:1", lambda storage, loc: None) == "cuda:1"
    assert _location("cuda:1", lambda storage, loc: storage) == "cpu"  # the CPU storage it was given
    assert _location("cuda:1", {"cuda:1": "cuda:0"}) == "cuda:0"
    assert _location("cuda:1", torch.device("cpu")) == "cpu"
    placed = _placed(checkpoint, "cuda:0", "meta")
    state = placed["state_dict"]
    assert all(t.device.type == "meta" for t in state.values())
    assert state["b.weight"] is state["a.weight"]  # tied weights stay one tensor
    assert _placed(checkpoint, "cpu", lambda s, loc: None) is checkpoint
