"""`StagerdCheckpointIO` and OmegaConf hyper-parameters, as Hydra users give them: a LightningModule's
`save_hyperparameters(cfg)` of a `DictConfig` (with nesting, a `ListConfig`, interpolations, struct mode),
and one whose init takes a config and a list config (a dict of them). A real Trainer on CPU saves through
the plugin and resumes from it with `fit(ckpt_path=...)`, against the same run with Lightning's own
`.ckpt`: the checkpoint's `hyper_parameters` (and `hparams_type`), what `on_load_checkpoint` sees on resume,
and the module Lightning's `load_from_checkpoint` builds from the dict are the same type with the same
content, interpolations unresolved. A value JSON cannot hold inside a config is refused by name, a
structured config too; loading a config without omegaconf installed is a named LoadError."""

from __future__ import annotations

import pathlib
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from omegaconf import DictConfig, ListConfig, OmegaConf

from stagerd.errors import LoadError, SaveInputError
from stagerd.integrations import omegaconf_values, state_tree
from stagerd.integrations.lightning import StagerdCheckpointIO


def _config() -> DictConfig:
    cfg = OmegaConf.create(
        {
            "model": {"width": 4, "out": 2, "init": {"gain": 1.0, "skip": [1, 2]}},
            "optim": {"lr": 0.1, "name": "adam"},
            "sched_lr": "${optim.lr}",
            "tags": ["tiny", "${optim.name}", {"k": "${model.width}"}],
            "layers": [4, "${model.width}", "${model.out}"],
        }
    )
    OmegaConf.set_struct(cfg, True)  # as Hydra composes it
    return cfg


class _Tiny(pl.LightningModule):
    seen: dict[str, Any]

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        return self.layer(batch[0]).pow(2).mean()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.seen = {k: checkpoint.get(k) for k in ("hyper_parameters", "hparams_type")}


class CfgModule(_Tiny):
    """`save_hyperparameters(cfg)`: the hparams are the DictConfig itself."""

    def __init__(self, cfg: DictConfig) -> None:
        super().__init__()
        self.save_hyperparameters(cfg)
        self.layer = torch.nn.Linear(self.hparams.model.width, self.hparams.model.out)
        self.seen = {}

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=self.hparams.sched_lr)  # resolved: optim.lr


class ArgsModule(_Tiny):
    """`save_hyperparameters()` of init arguments: a dict holding a DictConfig and a ListConfig."""

    def __init__(self, cfg: DictConfig, layers: ListConfig, scale: float = 0.5) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.layer = torch.nn.Linear(cfg.model.width, layers[-1])
        self.seen = {}

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=self.hparams.cfg.optim.lr * self.hparams.scale)


def _make(kind: str) -> _Tiny:
    if kind == "cfg":
        return CfgModule(_config())
    cfg = _config()
    return ArgsModule(cfg, cfg.layers)  # a part of the config, with interpolations into the rest


def _fit(out: Path, kind: str, staged: bool, steps: int, ckpt_path: str | None = None) -> _Tiny:
    from lightning.pytorch.callbacks import ModelCheckpoint

    torch.manual_seed(0)
    module = _make(kind)
    plugins = [StagerdCheckpointIO(out / "root", model=module)] if staged else []
    trainer = pl.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, plugins=plugins,
                         callbacks=[ModelCheckpoint(dirpath=out / "ckpts", every_n_train_steps=2,
                                                    filename="{step}", save_top_k=-1)])  # fmt: skip
    data = torch.utils.data.TensorDataset(torch.arange(32.0).reshape(8, 4) / 32)
    # Lightning's own file holds the config pickled: torch.load refuses it unless told to unpickle
    weights_only = None if staged else False
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=2), ckpt_path=ckpt_path,
                weights_only=weights_only)  # fmt: skip
    return module


def _assert_same(got: Any, want: Any) -> None:
    """The same type and content at every level, configs compared unresolved, with their flags."""
    assert type(got) is type(want)
    if isinstance(want, DictConfig | ListConfig):
        assert OmegaConf.to_container(got, resolve=False) == OmegaConf.to_container(want, resolve=False)
        assert OmegaConf.is_struct(got) == OmegaConf.is_struct(want)
        assert OmegaConf.is_readonly(got) == OmegaConf.is_readonly(want)
        assert got == want
    elif isinstance(want, dict):
        assert list(got) == list(want)
        for k in want:
            _assert_same(got[k], want[k])
    else:
        assert got == want


@pytest.fixture(scope="module", params=["cfg", "args"])
def runs(request, tmp_path_factory):
    kind = request.param
    out = {s: tmp_path_factory.mktemp(f"{kind}-{s}") for s in ("staged", "lightning")}
    for name, path in out.items():
        _fit(path, kind, staged=name == "staged", steps=4)
    return kind, out


def test_the_checkpoint_holds_what_lightnings_own_does(runs):
    kind, out = runs
    own = torch.load(out["lightning"] / "ckpts" / "step=4.ckpt", weights_only=False)
    staged = StagerdCheckpointIO(out["staged"] / "root").load_checkpoint(
        out["staged"] / "ckpts" / "step=4.ckpt"
    )
    hp = staged["hyper_parameters"]
    _assert_same(hp, own["hyper_parameters"])
    assert staged.get("hparams_type") is own.get("hparams_type")
    cfg = hp if kind == "cfg" else hp["cfg"]
    assert isinstance(cfg, DictConfig) and isinstance(cfg.tags, ListConfig)
    assert OmegaConf.to_container(cfg, resolve=False)["sched_lr"] == "${optim.lr}"  # not resolved at save
    assert (cfg.sched_lr, cfg.tags[1], cfg.tags[2].k) == (0.1, "adam", 4)
    if kind == "cfg":
        assert staged["hparams_type"] is DictConfig
    else:
        assert "hparams_type" not in staged
        layers = hp["layers"]
        assert isinstance(layers, ListConfig) and list(layers) == [4, 4, 2]
        assert OmegaConf.to_container(layers, resolve=False) == [4, "${model.width}", "${model.out}"]


def test_a_resumed_fit_sees_what_it_sees_from_lightnings_own(runs, tmp_path):
    kind, out = runs
    staged = _fit(out["staged"], kind, True, 6, ckpt_path=str(out["staged"] / "ckpts" / "step=4.ckpt"))
    own = _fit(out["lightning"], kind, False, 6, ckpt_path=str(out["lightning"] / "ckpts" / "step=4.ckpt"))
    assert staged.seen["hyper_parameters"] is not None
    _assert_same(staged.seen["hyper_parameters"], own.seen["hyper_parameters"])
    assert staged.seen["hparams_type"] is own.seen["hparams_type"]
    assert staged.trainer.global_step == own.trainer.global_step == 6
    for k, v in own.state_dict().items():
        torch.testing.assert_close(staged.state_dict()[k], v, rtol=0, atol=0)


def test_load_from_checkpoints_dict_builds_the_same_module(runs):
    """`load_from_checkpoint` reads its file with torch.load; from the dict this plugin loads, Lightning's
    `_load_state` (what it calls next) builds the module with the hyper-parameters Lightning's own gives."""
    from lightning.pytorch.core.saving import _load_state

    kind, out = runs
    cls = CfgModule if kind == "cfg" else ArgsModule
    staged = StagerdCheckpointIO(out["staged"] / "root").load_checkpoint(
        out["staged"] / "ckpts" / "step=4.ckpt"
    )
    own = torch.load(out["lightning"] / "ckpts" / "step=4.ckpt", weights_only=False)
    a, b = _load_state(cls, staged), _load_state(cls, own)
    _assert_same(
        a.hparams if kind == "cfg" else dict(a.hparams), b.hparams if kind == "cfg" else dict(b.hparams)
    )
    for k, v in b.state_dict().items():
        torch.testing.assert_close(a.state_dict()[k], v, rtol=0, atol=0)


def test_a_value_json_cannot_hold_inside_a_config_is_refused(tmp_path):
    cfg = _config()
    OmegaConf.set_struct(cfg, False)
    cfg.model.root = pathlib.Path("/data")
    with pytest.raises(SaveInputError, match=r"lightning/hyper_parameters/model/root: a pathlib\..*Path"):
        StagerdCheckpointIO(tmp_path / "root", model=CfgModule(cfg))
    # without `model=`, at the save
    module = ArgsModule(_config(), OmegaConf.create([4, b"\x00", 2]))
    io = StagerdCheckpointIO(tmp_path / "root")
    trainer = pl.Trainer(max_steps=1, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, plugins=[io])  # fmt: skip
    data = torch.utils.data.TensorDataset(torch.zeros(2, 4))
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=2))
    with pytest.raises(SaveInputError, match=r"lightning/hyper_parameters/layers/1: a builtins\.bytes"):
        trainer.save_checkpoint(tmp_path / "x.ckpt")


@dataclass
class Schema:
    width: int = 4


def test_a_structured_config_is_refused_by_name(tmp_path):
    for cfg in (OmegaConf.structured(Schema), OmegaConf.create({"model": OmegaConf.structured(Schema)})):
        with pytest.raises(SaveInputError, match=r"lightning/hyper_parameters: a structured OmegaConf"):
            omegaconf_values.split({"hyper_parameters": cfg}, "lightning")


def test_the_encoding_round_trips_and_is_unambiguous():
    cfg = OmegaConf.create(
        {"a": float("inf"), 3: "${a}", "__stagerd__": {"x": [None, True]}, "m": "???", "s": "\\${a}"},
        flags={"readonly": True},
    )
    lookalike = {"__stagerd__": "omegaconf", "type": "DictConfig", "flags": [], "content": {}}
    nested = OmegaConf.create({"a": 1, "b": {"c": [{"d": "${a}"}], "e": "${b.c}"}})
    tree = {"c": cfg, "lookalike": lookalike, "t": (ListConfig, DictConfig), "n": [OmegaConf.create([])],
            "parts": [nested.b.c, nested.b.c[0]]}  # fmt: skip
    tensors, skeleton = omegaconf_values.split(tree, "p")
    assert tensors == {}
    back = state_tree.join(
        omegaconf_values.restore(state_tree.from_blob(state_tree.to_blob(skeleton), "x"), "p"), {}.__getitem__
    )
    _assert_same(back["c"], cfg)
    assert back["c"][3] == float("inf") and OmegaConf.is_readonly(back["c"])
    assert OmegaConf.is_missing(back["c"], "m") and back["c"].s == "${a}"  # an escaped interpolation
    assert back["lookalike"] == lookalike  # a user's dict shaped like a node stays a dict
    assert back["t"] == (ListConfig, DictConfig)
    assert isinstance(back["n"][0], ListConfig)
    for got, want in zip(back["parts"], tree["parts"], strict=True):
        _assert_same(got, want)
    assert back["parts"][1].d == 1  # an interpolation into the config it is part of


def test_a_config_without_omegaconf_installed_is_a_named_load_error(runs, monkeypatch):
    _, out = runs
    io = StagerdCheckpointIO(out["staged"] / "root")
    monkeypatch.setitem(sys.modules, "omegaconf", None)  # what an environment without it gives `import`
    with pytest.raises(
        LoadError, match=r"step-00000004: .*OmegaConf DictConfig, .*omegaconf is not installed"
    ) as e:
        io.load_checkpoint(out["staged"] / "ckpts" / "step=4.ckpt")
    assert "pip install omegaconf" in e.value.hint
    # a state without a config needs no omegaconf
    assert omegaconf_values.restore({"a": [1]}, "x") == {"a": [1]}
