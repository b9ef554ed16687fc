"""A rank's random number generators as tensors, so a resumed run draws the same numbers as an
uninterrupted one: Python's `random`, NumPy's global generator, torch's CPU generator and, with CUDA,
every device's. Each rank saves its own under `rng/rank<N>/` in the step's `optim/`.

Python's and NumPy's states are tuples of integers (and one float), kept as JSON bytes in a uint8 tensor:
restoring them parses JSON, never a pickle.
"""

from __future__ import annotations

import random
from typing import Any

import torch

from stagerd.errors import LoadError
from stagerd.integrations.state_tree import from_blob, to_blob


def _prefix(rank: int) -> str:
    return f"rng/rank{rank}"


def capture(rank: int) -> dict[str, torch.Tensor]:
    """This rank's generators, each state a tensor of its own (copies: the generators move on)."""
    import numpy as np

    version, mt, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    host = {
        "python": [version, list(mt), gauss],
        "numpy": [name, np.asarray(keys).tolist(), pos, has_gauss, cached],
    }
    p = _prefix(rank)
    out = {f"{p}/host": to_blob(host), f"{p}/torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out[f"{p}/cuda"] = torch.stack(torch.cuda.get_rng_state_all())
    return out


def keys_of(rank: int, available: set[str]) -> list[str]:
    """The keys of this rank's saved generators among a step's `available` tensors."""
    p = f"{_prefix(rank)}/"
    return sorted(k for k in available if k.startswith(p))


def restore(rank: int, tensors: dict[str, torch.Tensor]) -> None:
    """Set this rank's generators from what `capture` saved (LoadError if it is malformed)."""
    import numpy as np

    p = _prefix(rank)
    host: Any = from_blob(tensors[f"{p}/host"], "the saved Python and NumPy generator state")
    try:
        version, mt, gauss = host["python"]
        name, keys, pos, has_gauss, cached = host["numpy"]
        py_state = (int(version), tuple(int(x) for x in mt), None if gauss is None else float(gauss))
        np_state = (str(name), np.asarray(keys, dtype=np.uint32), int(pos), int(has_gauss), float(cached))
    except (KeyError, TypeError, ValueError) as e:
        raise LoadError(f"malformed saved generator state of rank {rank}: {e!r}") from None
    random.setstate(py_state)
    np.random.set_state(np_state)
    torch.set_rng_state(tensors[f"{p}/torch"].to(torch.uint8))
    cuda = tensors.get(f"{p}/cuda")
    if cuda is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(list(cuda.unbind(0)))
