"""Lightning saving through the `Stager`: a `CheckpointIO` plugin.

    from stagerd.integrations.lightning import StagerdCheckpointIO

    trainer = L.Trainer(plugins=[StagerdCheckpointIO("/local_nvme/ckpt", model=module)], ...)
    trainer.fit(module, ckpt_path=None)                        # a fresh run
    trainer.fit(module, ckpt_path="/local_nvme/ckpt")          # resume: the newest committed step

`trainer.save_checkpoint(path)` and `ModelCheckpoint` save through it: Lightning's checkpoint dict becomes
one async `Stager.save` of step `global_step`. Its `state_dict` is the step's model (exported: with
`model=` the LightningModule, the transformers model inside it is exported as `save_pretrained` writes it,
and its `config.json` and `generation_config.json` go in as extras; a PEFT model inside it, or the
submodule given as `model=`, is staged under its own names, the module's other tensors beside the optimizer
state: `module_part`); every other tensor (optimizer state,
scheduler, callbacks' scores) goes into `optim/`, and everything else (loops, callbacks, hyper-parameters,
versions) is a JSON skeleton in a uint8 tensor there (`state_tree`; an OmegaConf `DictConfig` or
`ListConfig` among the hyper-parameters, as Hydra users give them, by `omegaconf_values`): `load_checkpoint`
restores it without unpickling anything, and a value JSON cannot hold exactly is refused at save time.

At `path` itself, a small JSON file names the step (ROOT and step) and the checkpoint's top-level keys, so
`ModelCheckpoint`'s bookkeeping (`last`, `best_model_path`, `save_top_k`) works on paths as always, and a
`save_weights_only` path loads the weights-only checkpoint Lightning's file would hold. A step is staged
once: a weights-only save is staged whole while another `ModelCheckpoint` saves everything (it may save
the same step next), and after `fit` a save at a staged step of weights changed since is a
`SaveInputError` (never a path that loads the weights of before). `load_checkpoint` accepts such a file,
a step directory (`ROOT/step-00000100`, or one `stagerd restore` brought back) or ROOT itself (its newest
committed step); so does `load_from_checkpoint(LitModel, path)` (`lightning_load`), what
`LitModel.load_from_checkpoint(path)` is for Lightning's own file, with no Trainer or plugin. The check of a
save after `fit` reads the staged model alone, a bounded run of tensors at a time. `remove_checkpoint`
removes the pointer file; the staged steps are the daemon's to keep or delete (`stagerd watch
--keep-last N`), all but the best: the step each `ModelCheckpoint`'s
`best_model_path` names, and with `save_top_k=k` (k > 0) each of its top k (`best_k_models`), is pinned
(`contract/step/pin.py`) by rank 0 from the save that makes it one of them (or from the load of a resumed
`fit`, for those it recorded) until it is no longer one, `release_pins()`, or the plugin is let go (its
trainer dropped) or the process ends, so `--keep-last` keeps them beside the newest N,
`trainer.test(ckpt_path="best")` after `fit` finds the best and each of `best_k_models` loads. Each step
staged also records those steps (`ckpt_best`): after the process ended, retention keeps the ones the newest
step records, for a later process's load of them or resumed `fit`. With `save_top_k=-1` (every
checkpoint) the best alone is pinned: the others are `--keep-last`'s. A best step gone anyway (deleted by
hand) fails to load with a `MarkerError`.

The loop blocks only for the copy: the next `optimizer.step()` waits for it, after the closure (forward
and backward) Lightning runs inside that step, right before the parameters change (`Stager.attach` on
the strategy's optimizers: the strategy that calls `save_checkpoint`, or the `model`'s trainer's). Where
the parameters may change in place before that step, the save itself waits for the copy: outside `fit`
(a `trainer.save_checkpoint` after it), and with Lightning's weight averaging (`EMAWeightAveraging`,
`StochasticWeightAveraging`), which swaps the averaged weights in for validation and copies them in when
training ends, and with an optimizer that has train and eval modes (schedule-free), switched for
validation.

Under Lightning Fabric (`Fabric(plugins=[io])`), `fabric.save(path, state)` stages the state's step, its
model the entry of `model=`'s state dict, and `fabric.load` reads it back (`fabric`). The save returns
before the copy too: the next `step()` of the state's optimizers waits for it (a state without one: the
save waits).

Lightning's DDP and single-device strategies save from global rank 0 alone (the state is replicated), so
the Stager here is rank 0's alone, on a gloo group of that one rank; every rank loads the whole step by
itself. Strategies that shard (FSDP, model parallel, DeepSpeed) do not use a CheckpointIO.
"""

from __future__ import annotations

import json
import logging
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.io import CheckpointIO

from stagerd.contract import layout
from stagerd.errors import ConfigError, SaveInputError, StepExistsError
from stagerd.integrations import fabric, hf_files, lightning_load, module_part, omegaconf_values, state_tree
from stagerd.integrations.ckpt_best import CheckpointBests, callback_paths
from stagerd.integrations.ckpt_pointer import POINTER, pointed
from stagerd.integrations.lightning_load import BLOB, FORMAT, load_from_checkpoint
from stagerd.ops.call_stack import calling_self
from stagerd.training.aliases import split_aliases
from stagerd.training.optimizer_hook import switches_modes
from stagerd.training.stager import Stager

log = logging.getLogger("stagerd.integrations")

__all__ = ["BLOB", "FORMAT", "StagerdCheckpointIO", "load_from_checkpoint"]


class StagerdCheckpointIO(CheckpointIO):
    """See the module docstring. `model`: the LightningModule (for a Hub-faithful export of the
    transformers model inside it); `save_options`: more keyword arguments of `Stager.save` (`dtype`,
    `extras`, `metadata`, `reference_index`, `mapping`); `stager_options`: of `Stager(...)`; `step_key`:
    under Fabric, the key of `fabric.save`'s state that holds the step."""

    def __init__(
        self,
        root: str | Path,
        *,
        model: Any = None,
        stager_options: Mapping[str, Any] | None = None,
        step_key: str = "step",
        **save_options: Any,
    ) -> None:
        if "optimizer_state" in save_options:
            raise SaveInputError("StagerdCheckpointIO saves Lightning's optimizer state itself")
        if model is not None:
            _check_hyper_parameters(model)
        self.root = Path(root)
        self.model = model
        self.save_options = save_options
        self.step_key = step_key  # under Fabric: the state's entry that is the step
        self.stager_options = dict(stager_options or {})
        self.stager: Stager | None = None
        self._group: Any = None  # rank 0's own gloo group, made once
        self._saved: tuple[int, frozenset[str]] | None = None  # the step staged last, and its keys
        self._best = CheckpointBests(self.root)  # the best steps, against the daemon's retention
        # a plugin let go (a sweep's finished trial) lets its pins go with it, not at the process's end
        weakref.finalize(self, self._best.release)

    # -- CheckpointIO ------------------------------------------------------------------------------

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None
    ) -> None:
        if storage_options is not None:
            raise TypeError("StagerdCheckpointIO takes no storage_options")
        if fabric.is_calling():
            self._save_fabric(checkpoint, Path(path))
            return
        step = int(checkpoint["global_step"])
        if self._saved is None or self._saved[0] != step:  # `last` and the top-k may save one step twice
            whole, trainer = self._whole(checkpoint), self._trainer()
            overlap = _a_step_changes_it_next(trainer)
            record = self._best.record(trainer, Path(path), step)  # for retention once the process ended
            self._save(
                whole, step, "state_dict", self.model, self._module(), self._optimizers(), overlap, record
            )
            self._saved = (step, frozenset(whole))
        elif not self._saved[1].issuperset(checkpoint):
            raise SaveInputError(
                f"step {step} was staged from a weights-only checkpoint: a full checkpoint of the same step "
                "cannot be staged too",
                path=path,
                hint="save the full checkpoint at another step, or with a ModelCheckpoint: then every "
                "weights-only save stages the whole checkpoint",
            )
        elif not _fitting(self._trainer()):  # within fit, two saves of one step hold the same weights
            self._check_unchanged(checkpoint, step, Path(path))
        self._point(Path(path), step, checkpoint)
        self._pin_best()  # ModelCheckpoint names its new best before it saves it

    def _save_fabric(self, state: dict[str, Any], path: Path) -> None:
        """`fabric.save(path, state)`: its step and model found in the state (`fabric`)."""
        step = fabric.step_of(state, self.step_key, path)
        key = fabric.model_key(state, self.model, path)
        if self._saved is None or self._saved[0] != step:
            model = None if self.model is None else fabric.unwrapped(self.model)
            optimizers = fabric.attach_to(model)
            for optimizer in optimizers or ():  # first: the save then leaves what their step changes
                self._stager().attach(optimizer)  # to the background copy (`eager`)
            self._save(state, step, key, model, None, optimizers, True)
            self._saved = (step, frozenset(state))
        else:  # a second path for the step: its weights must be the staged ones
            if (h := self.stager) is not None:
                h.wait()
            if not lightning_load.staged_weights_equal(self.root, step, state[key]):
                raise SaveInputError(
                    f"step {step} is already staged with other weights: the weights changed since cannot "
                    "be staged at the same step",
                    path=path,
                    hint="save them at another step, or under another ROOT (its own StagerdCheckpointIO)",
                )
        self._point(path, step, state)

    def _point(self, target: Path, step: int, checkpoint: Mapping[str, Any]) -> None:
        """The pointer file at `target`, with the keys the checkpoint file there would hold: a weights-only
        path loads no training state."""
        root = str(self.root.resolve())
        pointer = {"format": POINTER, "root": root, "step": step, "keys": sorted(checkpoint)}
        target.parent.mkdir(parents=True, exist_ok=True)
        layout.write_bytes_atomic(target, (json.dumps(pointer) + "\n").encode())

    def load_checkpoint(
        self, path: _PATH, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        if (h := self.stager) is not None:
            h.wait()  # a save of ours still writing: load what it commits
        checkpoint, _ = lightning_load.read(Path(path))
        trainer = self._trainer()
        if trainer is not None and trainer.state.fn == "fit" and trainer.is_global_zero:
            # resuming: each ModelCheckpoint takes back the best it recorded; the saving rank holds it
            # from now, not from the resumed run's first save
            self._best.pin_recorded(trainer, checkpoint.get("callbacks"))
        return checkpoint

    def remove_checkpoint(self, path: _PATH) -> None:
        target = Path(path)
        if pointed(target) is not None:
            target.unlink()

    def release_pins(self) -> None:
        """Let the daemon's retention delete the best steps again, once the run needs them no more (after
        `trainer.test(ckpt_path="best")`); a later save or resumed `fit` pins its best again."""
        self._best.release()

    def teardown(self) -> None:
        stager, self.stager = self.stager, None
        if stager is not None:
            stager.close()  # every save committed, or its SaveError raised here

    # -- internals ---------------------------------------------------------------------------------

    def _check_unchanged(self, checkpoint: dict[str, Any], step: int, path: Path) -> None:
        """A step is staged once: after `fit` (a merge, a quantization since), a path naming it must not
        stand for other weights."""
        if (h := self.stager) is not None:
            h.wait()  # the step's own save may still be writing it
        part = None if "mapping" in self.save_options else module_part.find(self.model, self._module())
        if lightning_load.staged_weights_equal(self.root, step, checkpoint["state_dict"], part):
            return
        raise SaveInputError(
            f"step {step} is already staged with other weights: the weights changed since cannot be "
            "staged at the same step",
            path=path,
            hint="save them under another ROOT (a StagerdCheckpointIO of its own), or with torch.save",
        )

    def _whole(self, checkpoint: dict[str, Any]) -> dict[str, Any]:
        """The checkpoint to stage: a weights-only one (`save_weights_only`) is staged whole while another
        ModelCheckpoint of the trainer saves everything, since that one may save this same step next and a
        step is staged once."""
        trainer = self._trainer()
        if "optimizer_states" in checkpoint or trainer is None:
            return checkpoint
        if all(getattr(c, "save_weights_only", True) for c in trainer.checkpoint_callbacks):
            return checkpoint
        if any(hasattr(o, "consolidate_state_dict") for o in trainer.optimizers):
            return checkpoint  # gathering a ZeRO optimizer's state is a collective; rank 0 alone is here
        whole: dict[str, Any] = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        return whole

    def _save(
        self,
        checkpoint: dict[str, Any],
        step: int,
        key: str,
        model: Any,
        module: Any,
        optimizers: list[Any] | None,
        overlap: bool,
        record: Mapping[str, bytes] | None = None,
    ) -> None:
        """Stage `checkpoint[key]` as the step's model (exported as `model`'s, `module` the LightningModule
        it is a part of) and the rest beside it, `record` among the extras; return before the host copy
        is done where `overlap` and `optimizers` (attached: their next step waits for it)."""
        state = dict(checkpoint)
        model_sd = dict(state.pop(key))
        tensors, skeleton = omegaconf_values.split(state, "lightning")
        _, aliases = split_aliases(model_sd)
        keys = list(model_sd)
        device = next((str(v.device) for v in model_sd.values() if isinstance(v, torch.Tensor)), "cpu")
        # `device`: where load_from_checkpoint puts the weights, as torch.load puts those of Lightning's file
        blob = {"format": FORMAT, "checkpoint": skeleton, "state_dict_keys": keys, "aliases": aliases,
                "device": device}  # fmt: skip
        if key != "state_dict":
            blob |= {"format": fabric.FORMAT, "model_key": key}
        options = dict(self.save_options)
        staged = model_sd
        part = None if "mapping" in options else module_part.find(model, module)
        if part is not None:  # the export is planned from the part's own names
            staged, outside = part.split(model_sd, aliases)
            tensors |= {name: model_sd[k] for k, name in outside.items()}
            blob["part"] = part.to_json(outside)
            model = part.model
        optim = {**tensors, BLOB: state_tree.to_blob(blob)}
        extras = {**hf_files.model_files(model), **(options.pop("extras", None) or {}), **(record or {})}
        if "mapping" not in options:
            options["model"] = model
        stager = self._stager()
        try:
            stager.save(staged, step=step, extras=extras, optimizer_state=optim, **options)
        except StepExistsError:
            log.warning("step %d is already committed under %s; not saved again", step, self.root)
            return
        if optimizers is None or not overlap:
            stager.wait_staged()  # nothing would wait for the copy before the tensors change
        for optimizer in optimizers or ():
            stager.attach(optimizer)  # once each: the next step waits after its closure

    def _pin_best(self) -> None:
        """Hold the steps each `ModelCheckpoint` keeps as its best now (`ckpt_best`)."""
        trainer = self._trainer()
        if trainer is not None:  # else a save outside a Trainer: there is no best
            self._best.pin(callback_paths(trainer))

    def _module(self) -> Any:
        """The LightningModule saved: the calling strategy's, else `model` where it is one."""
        from lightning.pytorch import LightningModule

        module = getattr(self._strategy(), "lightning_module", None)
        return (
            module
            if module is not None
            else (self.model if isinstance(self.model, LightningModule) else None)
        )

    def _trainer(self) -> Any:
        module = getattr(self._strategy(), "lightning_module", None)
        return getattr(module, "_trainer", None) or getattr(self.model, "_trainer", None)

    def _optimizers(self) -> list[Any] | None:
        """The torch optimizers of the strategy saving this checkpoint, None when there is none."""
        strategy = self._strategy()
        return None if strategy is None else list(strategy.optimizers)

    def _strategy(self) -> Any:
        """The strategy calling this plugin (found on the call stack), else the `model`'s
        trainer's; None when neither is found."""
        from lightning.pytorch.strategies import Strategy

        strategy = calling_self(Strategy)  # type: ignore[type-abstract]  # an isinstance check only
        if strategy is not None:
            return strategy
        trainer = getattr(self.model, "_trainer", None)
        return getattr(trainer, "strategy", None)

    def _stager(self) -> Stager:
        if self.stager is None:
            options = dict(self.stager_options)
            if dist.is_available() and dist.is_initialized():
                rank = dist.get_rank()
                if rank != 0:
                    raise ConfigError(
                        f"StagerdCheckpointIO was asked to save on rank {rank}: a strategy that saves from "
                        "every rank",
                        hint="use Lightning's DDP or single-device strategy",
                    )
                # Lightning saves from rank 0 alone: the Stager's collectives must not wait for the others
                if self._group is None:
                    self._group = dist.new_group([rank], use_local_synchronization=True)
                options.setdefault("process_group", self._group)
            self.stager = Stager(self.root, **options)
        return self.stager


def _fitting(trainer: Any) -> bool:
    return trainer is not None and trainer.state.fn == "fit" and trainer.state.status == "running"


def _a_step_changes_it_next(trainer: Any) -> bool:
    """Whether the next change to what was saved is an optimizer step, which waits for the copy: only while
    `fit` runs, and not with Lightning's weight averaging (EMA, SWA) or an optimizer with train and eval
    modes (schedule-free), which write the parameters in place for validation and when training ends,
    with no step in between."""
    from lightning.pytorch.callbacks import StochasticWeightAveraging, WeightAveraging

    if not _fitting(trainer):
        return False
    averaging = (WeightAveraging, StochasticWeightAveraging)
    if any(switches_modes(o) for o in trainer.optimizers):
        return False
    return not any(isinstance(c, averaging) for c in trainer.callbacks)


def _check_hyper_parameters(module: Any) -> None:
    """Every checkpoint holds the module's hyper-parameters: one JSON cannot hold (a transformers config
    given to `save_hyperparameters()`) would fail the first save, after every step before it."""
    hparams = getattr(module, "hparams", None)
    if hparams is None:
        return
    try:  # as the checkpoint holds them: an OmegaConf config itself, else a dict
        omegaconf_values.split({"hyper_parameters": hparams}, "lightning")
    except SaveInputError as e:
        raise SaveInputError(
            f"{e.message} (the LightningModule's hyper-parameters, in every checkpoint)",
            hint="leave it out with save_hyperparameters(ignore=[...]), or give it as numbers, strings, "
            "lists and dicts (a config as config.to_dict()); stagerd never pickles",
        ) from None
