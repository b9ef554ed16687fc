"""What a committed step holds, read without unpickling anything: the tensors of its `optim/` (from DCP's
metadata, through the allowlist unpickler) and the model tensors its marker lists.

DCP stores a non-tensor value as a pickle and loads it with `torch.load(weights_only=False)`. The
integrations never save one (non-tensor state is JSON in a uint8 tensor), and refuse to load a step whose
`optim/` claims one of the keys they ask for as bytes: a replaced `.metadata` cannot turn a tensor read
into an unpickle.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from stagerd.contract import layout
from stagerd.contract.dtypes import safetensors_name
from stagerd.errors import DTypeError, LoadError
from stagerd.training.safe_metadata import SafeFileSystemReader

Specs = dict[str, tuple[torch.dtype, tuple[int, ...]]]


def optim_specs(step_dir: Path) -> Specs:
    """Every tensor of the step's `optim/`: key -> (dtype, global shape). LoadError if `optim/` holds a
    value that is not a tensor (stagerd's integrations never write one)."""
    path = step_dir / layout.OPTIM_DIR
    if not (path / ".metadata").is_file():
        return {}
    meta = SafeFileSystemReader(str(path)).read_metadata()
    out: Specs = {}
    for key, md in meta.state_dict_metadata.items():
        if not isinstance(md, TensorStorageMetadata):
            raise LoadError(
                f"optim/ holds {key!r} as pickled bytes, which this loader never unpickles",
                path=path,
                hint="this step was not saved by a stagerd integration; load it with Stager.load",
            )
        out[key] = (md.properties.dtype, tuple(md.size))
    return out


def model_specs(marker: layout.CommitMarker) -> Specs:
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
