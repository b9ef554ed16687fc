"""Load templates of a committed step, made without the state dicts it was saved from: the model tensors
its marker lists (`model_specs`) and those of its `optim/` (`stagerd.training.loader.optim_specs`), as
empty tensors of the saved dtype and global shape (`empty`). The integrations keep every non-tensor
value in JSON inside a uint8 tensor (`state_tree`), so a step of theirs loads as tensors alone.
"""

from __future__ import annotations

import torch

from stagerd.contract import commit_marker
from stagerd.contract.dtypes import safetensors_name
from stagerd.errors import DTypeError, LoadError

Specs = dict[str, tuple[torch.dtype, tuple[int, ...]]]


def model_specs(marker: commit_marker.CommitMarker) -> Specs:
    """The model tensors the marker lists: name -> (dtype, global shape)."""
    if marker.tensors is None:
        raise LoadError("the commit marker lists no tensors", hint="re-save the step with this stagerd")
    by_name = _safetensors_dtypes()
    out: Specs = {}
    for name, info in marker.tensors.items():
        dtype = by_name.get(info.dtype)
        if dtype is None:
            raise LoadError(f"model tensor {name!r} has a dtype this loader does not know: {info.dtype}")
        out[name] = (dtype, tuple(info.shape))
    return out


def empty(specs: Specs) -> dict[str, torch.Tensor]:
    """Load templates: DCP reads into tensors of the saved dtype and shape."""
    return {k: torch.empty(shape, dtype=dtype) for k, (dtype, shape) in specs.items()}


def _safetensors_dtypes() -> dict[str, torch.dtype]:
    out: dict[str, torch.dtype] = {}
    for d in vars(torch).values():
        if isinstance(d, torch.dtype):
            try:
                out.setdefault(safetensors_name(d), d)
            except DTypeError:
                continue  # a dtype safetensors cannot hold: never in a marker
    return out
