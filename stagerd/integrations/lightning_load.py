"""Reading back what `StagerdCheckpointIO` staged, with no Trainer or Stager in the process.

    from stagerd.integrations.lightning import load_from_checkpoint

    model = load_from_checkpoint(LitModel, trainer.checkpoint_callback.best_model_path)

`load_from_checkpoint(cls, path, ...)` is `cls.load_from_checkpoint(path, ...)` for a stagerd checkpoint
path (the pointer file at a `ModelCheckpoint` path, `ROOT/step-N`, or ROOT: its newest committed step),
which Lightning's classmethod cannot read (it unpickles the path itself). The checkpoint is read as the
plugin's `load_checkpoint` reads it (`read`), its tensors placed as `torch.load` would place Lightning's own
file's (on the device they were saved from, unless that accelerator is absent or `map_location` says
otherwise), and the rest is Lightning's own code: its checkpoint migration, `hparams_file`, the keyword
overrides, `_load_state` (the class built from the hyper-parameters, `configure_model`,
`on_load_checkpoint`, `load_state_dict(strict=...)`) and the move to the weights' device. A
`LightningDataModule` loads the same way.

`staged_weights_equal` compares a state dict with a staged step's model a bounded chunk of tensors at a
time (`CHUNK_BYTES`, or one tensor larger than that), reading nothing of its `optim/`.
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

import lightning.pytorch as pl
import torch
from lightning.pytorch.core import saving

from stagerd.contract import commit_marker, layout
from stagerd.errors import LoadError
from stagerd.integrations import fabric, module_part, omegaconf_values, state_tree, step_files
from stagerd.integrations.ckpt_pointer import NOT_OURS_HINT, locate
from stagerd.training.aliases import split_aliases
from stagerd.training.collectives import Collectives
from stagerd.training.loader import load_step, optim_specs

BLOB = "stagerd/lightning"
FORMAT = "stagerd.lightning/1"
CHUNK_BYTES = 256 << 20

T = TypeVar("T", bound="pl.LightningModule | pl.LightningDataModule")


def read(path: Path) -> tuple[dict[str, Any], str]:
    """Lightning's checkpoint dict at a stagerd checkpoint path (tensors on the CPU), and the device its
    `state_dict` was saved from ("cpu" for a step that does not record it)."""
    root, step, kept = locate(path)
    step_dir = root / layout.step_dir_name(step)
    marker = commit_marker.read_marker(step_dir)
    model = step_files.empty(step_files.model_specs(marker))
    specs = optim_specs(step_dir)
    if BLOB not in specs:
        raise LoadError(
            "not a step saved by StagerdCheckpointIO (no Lightning state)", path=step_dir, hint=NOT_OURS_HINT
        )
    optim = step_files.empty(specs)
    _load(root, model, optim, step)
    blob = state_tree.from_blob(optim[BLOB], "the saved Lightning state")
    if not isinstance(blob, dict) or blob.get("format") not in (FORMAT, fabric.FORMAT):
        raise LoadError("the saved Lightning state is not in a format this stagerd knows", path=step_dir)
    skeleton = omegaconf_values.restore(blob["checkpoint"], step_dir)
    checkpoint = state_tree.join(skeleton, optim.__getitem__)
    aliases = blob.get("aliases") or {}
    tensor = module_part.joined(blob, model, optim.__getitem__)
    key = str(blob.get("model_key", "state_dict"))  # under Fabric, the state's entry of the model
    checkpoint[key] = {k: tensor(aliases.get(k, k)) for k in blob["state_dict_keys"]}
    if kept is not None:
        checkpoint = {k: v for k, v in checkpoint.items() if k in kept}
    device = blob.get("device")
    return checkpoint, device if isinstance(device, str) else "cpu"


def staged_weights_equal(
    root: Path, step: int, state_dict: Mapping[str, torch.Tensor], part: module_part.Part | None = None
) -> bool:
    """Whether the committed step holds `state_dict` (same keys, dtypes, shapes and bytes; a tied key is
    staged once, under the first key of its tensor): in its model, or with `part`, the part's tensors in
    its model and the module's others beside its optimizer state."""
    if part is None:
        return _model_holds(root, step, state_dict)
    if not all(isinstance(v, torch.Tensor) for v in state_dict.values()):
        return False
    inner, outside = part.split(state_dict, split_aliases(dict(state_dict))[1])
    if not _model_holds(root, step, inner):
        return False
    specs = optim_specs(root / layout.step_dir_name(step))
    given = {name: state_dict[key] for key, name in outside.items()}
    if any(specs.get(n) != (t.dtype, tuple(t.shape)) for n, t in given.items()):
        return False
    staged = step_files.empty({n: specs[n] for n in given})
    _load(root, {}, staged, step)
    return all(_same_bits(staged[n], t) for n, t in given.items())


def _model_holds(root: Path, step: int, state_dict: Mapping[str, torch.Tensor]) -> bool:
    specs = step_files.model_specs(commit_marker.read_marker(root / layout.step_dir_name(step)))
    _, aliases = split_aliases(dict(state_dict))
    readers: dict[str, list[str]] = {}  # staged name -> the keys of state_dict holding it
    for key, given in state_dict.items():
        name = key if key in specs else aliases.get(key)
        if not isinstance(given, torch.Tensor) or name is None:
            return False
        if specs.get(name) != (given.dtype, tuple(given.shape)):
            return False
        readers.setdefault(name, []).append(key)
    if readers.keys() != specs.keys():
        return False
    for names in _chunks(specs):
        staged = step_files.empty({n: specs[n] for n in names})
        _load(root, staged, None, step)
        for name, tensor in staged.items():
            if not all(_same_bits(tensor, state_dict[k]) for k in readers[name]):
                return False
        del staged
    return True


def load_from_checkpoint(
    cls: type[T],
    checkpoint_path: str | os.PathLike[str],
    map_location: Any = None,
    hparams_file: str | os.PathLike[str] | None = None,
    strict: bool | None = None,
    weights_only: bool | None = None,
    **kwargs: Any,
) -> T:
    """`cls.load_from_checkpoint(checkpoint_path, ...)` for a stagerd checkpoint path (see the module
    docstring); `cls` a LightningModule or LightningDataModule class. `weights_only` is accepted for the
    same call's sake: nothing here is unpickled."""
    from lightning.pytorch.utilities.migration.utils import _pl_migrate_checkpoint
    from lightning.pytorch.utilities.rank_zero import rank_zero_warn

    del weights_only
    if not (isinstance(cls, type) and issubclass(cls, (pl.LightningModule, pl.LightningDataModule))):
        raise TypeError(f"load_from_checkpoint takes a LightningModule or LightningDataModule class: {cls!r}")
    path = Path(checkpoint_path)
    checkpoint, saved_on = read(path)
    checkpoint = _placed(checkpoint, saved_on, map_location or saving._default_map_location)
    checkpoint = _pl_migrate_checkpoint(checkpoint, checkpoint_path=path)
    key = cls.CHECKPOINT_HYPER_PARAMS_KEY
    if hparams_file is not None:
        extension = str(hparams_file).rsplit(".", 1)[-1].lower()
        if extension == "csv":
            checkpoint[key] = saving.load_hparams_from_tags_csv(Path(hparams_file))
        elif extension in ("yml", "yaml"):
            checkpoint[key] = saving.load_hparams_from_yaml(Path(hparams_file))
        else:
            raise ValueError(".csv, .yml or .yaml is required for `hparams_file`")
    checkpoint.setdefault(key, {})
    checkpoint[key].update(kwargs)
    loaded: Any
    if issubclass(cls, pl.LightningDataModule):
        loaded = saving._load_state(cls, checkpoint, **kwargs)
        return loaded
    loaded = saving._load_state(cls, checkpoint, strict=strict, **kwargs)
    state_dict = checkpoint["state_dict"]
    if not state_dict:
        rank_zero_warn(f"The state dict in {str(path)!r} contains no parameters.")
        return loaded
    device = next((t for t in state_dict.values() if isinstance(t, torch.Tensor)), torch.tensor(0)).device
    return loaded.to(device)


def _placed(checkpoint: dict[str, Any], saved_on: str, map_location: Any) -> dict[str, Any]:
    """The checkpoint's tensors where `torch.load(map_location=...)` puts those of a file saved from
    `saved_on`; a tensor two keys share (tied weights) stays shared."""
    from lightning_utilities.core.apply_func import apply_to_collection

    target = torch.device(_location(saved_on, map_location))
    if target.type == "cpu":
        return checkpoint  # read onto the CPU
    moved: dict[int, torch.Tensor] = {}

    def move(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in moved:
            moved[id(t)] = t.to(target)
        return moved[id(t)]

    placed: dict[str, Any] = apply_to_collection(checkpoint, torch.Tensor, move)
    return placed


def _location(saved_on: str, map_location: Any) -> str:
    """Where `torch.load` puts a storage saved at `saved_on` (a function is asked about an empty one)."""
    if isinstance(map_location, (str, torch.device)):
        return str(map_location)
    if isinstance(map_location, Mapping):
        return str(map_location.get(saved_on, saved_on))
    if callable(map_location):
        storage = map_location(torch.UntypedStorage(0), saved_on)
        return saved_on if storage is None else str(storage.device)
    raise TypeError(f"map_location must be a device, a str, a dict or a function, not {map_location!r}")


def _load(root: Path, model: dict[str, torch.Tensor], optim: dict[str, Any] | None, step: int) -> None:
    with warnings.catch_warnings():  # every rank reads the whole step by itself, on purpose
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        load_step(Collectives(None), root, model, optim, step)


def _chunks(specs: step_files.Specs) -> Iterator[list[str]]:
    """The staged names in runs of at most `CHUNK_BYTES` (a larger tensor alone)."""
    run: list[str] = []
    size = 0
    for name, (dtype, shape) in specs.items():
        nbytes = dtype.itemsize * math.prod(shape)
        if run and size + nbytes > CHUNK_BYTES:
            yield run
            run, size = [], 0
        run.append(name)
        size += nbytes
    if run:
        yield run


def _same_bits(staged: torch.Tensor, given: torch.Tensor) -> bool:
    mine = given.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    return torch.equal(staged.reshape(-1).view(torch.uint8), mine)
