"""The Trainer's checkpoint state as one stagerd step, and back: what `StagerdCallback` saves and loads.

A step holds, besides the model (`model/`, sharded as trained: DDP's replicas once, FSDP2's shards):
- `optim/optimizer/...`: the optimizer's tensors, by parameter name (torch's `get_optimizer_state_dict`,
  so a step loads under another world size or sharding);
- `optim/rng/rank<N>/...`: each rank's random number generators (`rng`);
- `optim/stagerd/trainer`: everything else (the optimizer's param groups, the LR scheduler, the AMP
  grad scaler), JSON in a uint8 tensor (`state_tree`);
- `extras/trainer_state.json` and whatever else the Trainer (or a subclass) wrote beside it into the
  checkpoint folder, which `Trainer.train(resume_from_checkpoint=...)` reads from `extras/` itself.
Nothing in it is a pickle.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from stagerd.contract import layout
from stagerd.errors import LoadError, SaveInputError
from stagerd.integrations import rng, state_tree, step_files
from stagerd.training.aliases import split_aliases
from stagerd.training.loader import optim_specs
from stagerd.training.optimizer_hook import switches_modes

BLOB = "stagerd/trainer"
FORMAT = "stagerd.hf_trainer/1"


@dataclass
class Captured:
    """What the Trainer's own `_save_checkpoint` asked to be saved, taken at the moment it asked."""

    optimizer: bool = False  # optimizer and LR scheduler (not with save_only_model)
    scaler: bool = False
    rng: dict[str, torch.Tensor] = field(default_factory=dict)
    pushed: bool = False


@dataclass(frozen=True)
class Restored:
    """What is set later than the model and optimizer, where the Trainer sets it."""

    rng: dict[str, torch.Tensor]
    scaler: Any


def torch_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside Accelerate's `AcceleratedOptimizer`."""
    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    return optimizer


def writes_before_its_step(optimizer: Any) -> bool:
    """Whether the parameters change before the optimizer's next step, where a save's copy is waited for:
    an optimizer with train and eval modes (schedule-free), which the Trainer switches to eval before it
    evaluates and saves and back before the next forward, each switch writing the parameters in place;
    or the Trainer's layer-wise optimizers (`optim="galore_adamw_layerwise"`, ...), which update each
    parameter from a hook during the backward, their `LayerWiseDummyOptimizer`'s step doing nothing."""
    inner = torch_optimizer(optimizer)
    return layer_wise(inner) or switches_modes(inner)


def layer_wise(optimizer: torch.optim.Optimizer) -> bool:
    """The Trainer's stand-in for its layer-wise optimizers: the state is the per-parameter optimizers',
    which the Trainer's own checkpoint does not hold either, so a step holds none."""
    from transformers.trainer_pt_utils import LayerWiseDummyOptimizer

    return isinstance(optimizer, LayerWiseDummyOptimizer)


def _state_dicts(model: Any, optimizer: torch.optim.Optimizer) -> tuple[dict[str, Any], dict[str, Any], Any]:
    """(the model's state dict, the optimizer's tensors, its JSON skeleton), as saved and as loaded into; a
    layer-wise stand-in has no state (None for the skeleton)."""
    if layer_wise(optimizer):
        return get_model_state_dict(model), {}, None
    msd, osd = get_state_dict(model, optimizer)
    return msd, *state_tree.split(osd, "optimizer")


def state_to_save(
    trainer: Any, captured: Captured, rank: int
) -> tuple[dict[str, Any], dict[str, torch.Tensor] | None]:
    """The model state dict and the `optim/` tensors of one save (None with save_only_model)."""
    model = trainer.model
    if not captured.optimizer:
        return get_model_state_dict(model), None
    optimizer = torch_optimizer(trainer.optimizer)
    try:
        msd, out, skeleton = _state_dicts(model, optimizer)
    except KeyError:  # torch's, for a parameter without a name in the model
        _check_model_params(model, optimizer)
        raise
    blob: dict[str, Any] = {"format": FORMAT, "optimizer": skeleton, "scheduler": None, "scaler": None}
    scheduler = getattr(trainer, "lr_scheduler", None)
    if scheduler is not None:
        tensors, blob["scheduler"] = state_tree.split(scheduler.state_dict(), "scheduler")
        out.update(tensors)
    scaler = _scaler(trainer) if captured.scaler else None
    if scaler is not None:
        tensors, blob["scaler"] = state_tree.split(scaler.state_dict(), "scaler")
        out.update(tensors)
    out.update(captured.rng)
    if rank == 0:  # the same on every rank: one copy
        out[BLOB] = state_tree.to_blob(blob)
    return msd, out


def load(trainer: Any, stager: Any, step: int) -> Restored:
    """Load `step` into the Trainer's model, optimizer and LR scheduler (collective, every rank)."""
    step_dir: Path = stager.step_dir(step)
    model = trainer.model
    optimizer = torch_optimizer(trainer.optimizer)
    if not (step_dir / layout.OPTIM_DIR).is_dir():  # saved with save_only_model: the model alone
        load_model(trainer, stager, step)
        return Restored({}, None)
    specs = optim_specs(step_dir)
    if BLOB not in specs:
        raise LoadError(
            f"optim/ holds no {BLOB!r}: not a step StagerdCallback saved",
            path=step_dir,
            hint="load it with Stager.load, or resume from a step the callback saved",
        )
    msd, templates, _ = _state_dicts(model, optimizer)
    _check_same_optimizer(set(templates), {k for k in specs if k.startswith("optimizer/")}, step_dir)
    rank = stager.rank
    wanted = [BLOB, *rng.keys_of(rank, set(specs))]
    wanted += [k for k in specs if k.startswith(("scheduler/", "scaler/"))]
    templates.update(step_files.empty({k: specs[k] for k in wanted}))
    stager.load(split_aliases(msd)[0], templates, step=step)
    blob = state_tree.from_blob(templates[BLOB], "the saved trainer state")
    if not isinstance(blob, dict) or blob.get("format") != FORMAT:
        raise LoadError("the saved trainer state is not in a format this stagerd knows", path=step_dir)
    set_model_state_dict(model, msd)
    if blob.get("optimizer") is not None:
        set_optimizer_state_dict(model, optimizer, state_tree.join(blob["optimizer"], templates.__getitem__))
    scheduler = getattr(trainer, "lr_scheduler", None)
    if scheduler is not None and blob.get("scheduler") is not None:
        scheduler.load_state_dict(state_tree.join(blob["scheduler"], templates.__getitem__))
    scaler = None if blob.get("scaler") is None else state_tree.join(blob["scaler"], templates.__getitem__)
    return Restored({k: templates[k] for k in rng.keys_of(rank, set(specs))}, scaler)


def load_model(trainer: Any, stager: Any, step: int) -> None:
    """Load the model weights of `step` alone, as sharded or replicated as trained (collective)."""
    msd = get_model_state_dict(trainer.model)
    stager.load(split_aliases(msd)[0], step=step)
    set_model_state_dict(trainer.model, msd)


def restore_scaler(trainer: Any, state: Any) -> None:
    scaler = _scaler(trainer)
    if scaler is not None and state is not None:
        scaler.load_state_dict(state)


def _scaler(trainer: Any) -> Any:
    return getattr(getattr(trainer, "accelerator", None), "scaler", None)


def _check_model_params(model: Any, optimizer: torch.optim.Optimizer) -> None:
    """The optimizer's state is saved by parameter name, from the model: one it steps outside the model
    has none. Checked after torch's state dict call, whose hooks put FSDP2's sharded parameters back in
    the model: before it, the root module's may still be the unsharded ones."""
    mine = {id(p) for p in model.parameters()}
    outside = [p for g in optimizer.param_groups for p in g["params"] if id(p) not in mine]
    if outside:
        raise SaveInputError(
            f"the Trainer's optimizer steps {len(outside)} parameter(s) not the model's: a step saves the "
            "optimizer's state by the model's parameter names",
            hint="make the parameter part of the model (a submodule or nn.Parameter attribute of it)",
        )


def _check_same_optimizer(mine: set[str], saved: set[str], step_dir: Path) -> None:
    if mine == saved:
        return
    missing, extra = sorted(saved - mine)[:3], sorted(mine - saved)[:3]
    raise LoadError(
        f"the optimizer's state does not match the step's: saved but not here {missing}, here but not "
        f"saved {extra}",
        path=step_dir,
        hint="resume with the model, optimizer and trainable parameters the step was saved with",
    )
