"""What a save's leaves may be: checked in `save()`, so that a committed step always loads back.

Tensors must have data (not meta) and a dtype safetensors stores. The optimizer state's other leaves are
written with `torch.save` and read back at resume by torch's weights-only unpickler, which refuses most
classes: a value it refuses (a `Path`, an enum, an object of the user's) would commit a step that no
resume can load, so `save()` refuses it instead, naming the leaf. numpy arrays, scalars and dtypes (what
`np.random.get_state()` returns) are read back through an allowlist of numpy's own reconstructors, so an
RNG state saved as numpy loads as numpy. Plain values are passed by type, without pickling them, since
this runs inside the training loop's stall; anything else is round-tripped through the load's unpickler.
"""

from __future__ import annotations

import io
import re
from collections.abc import Mapping
from typing import IO, Any

import numpy as np
import torch

from stagerd.contract.dtypes import safetensors_name
from stagerd.errors import DTypeError, SaveInputError

# numpy's own names for them, taken from its reducers: numpy 2 moved them from numpy.core to numpy._core.
# numpy 2 builds each dtype through its class (`numpy.dtypes.Int64DType`).
_NUMPY_GLOBALS: list[Any] = [
    np.dtype,
    np.ndarray,
    np.zeros(1).__reduce__()[0],
    np.float32(0).__reduce__()[0],
    *dict.fromkeys(type(np.dtype(c)) for c in np.typecodes["All"]),
]
_PLAIN = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device)
_STORABLE: dict[torch.dtype, bool] = {}
_VALUES_HINT = (
    "an optimizer state's non-tensor values must be numbers, strings, None, tuples of them, torch dtypes "
    "or numpy arrays; pass other state as tensors, or as JSON in extras"
)


def load_values(f: IO[bytes]) -> Any:
    """The leaves an `objects_file` holds, through torch's weights-only unpickler and numpy's allowlist."""
    with torch.serialization.safe_globals(_NUMPY_GLOBALS):
        return torch.load(f, map_location="cpu", weights_only=True)


def _plain(value: Any) -> bool:
    if type(value) in _PLAIN:
        return True
    if type(value) in (tuple, list, set, frozenset, torch.Size):
        return all(_plain(v) for v in value)
    if type(value) is dict:
        return all(_plain(k) and _plain(v) for k, v in value.items())
    return False


def _cause(e: Exception) -> str:
    """The line of torch's many that names what was refused."""
    text = str(e)
    if found := re.search(r"GLOBAL (\S+) was not an allowed global|but got (<[^>]*>)", text):
        return f"the load's unpickler refuses {found.group(1) or found.group(2)}"
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return f"{type(e).__name__}: {lines[0][:200]}" if lines else type(e).__name__


def check_values(values: Mapping[str, Any], what: str) -> None:
    """Refuse a non-tensor leaf that the load could not read back (SaveInputError naming it)."""
    for name, value in values.items():
        if _plain(value):
            continue
        try:
            buf = io.BytesIO()
            torch.save(value, buf)
            buf.seek(0)
            load_values(buf)
        except Exception as e:
            cause = _cause(e)
            raise SaveInputError(
                f"{what} value {name!r} is a {type(value).__name__}, which a resume could not load back "
                f"({cause})",
                hint=_VALUES_HINT,
            ) from None


def check_tensor(name: str, t: torch.Tensor, what: str) -> None:
    """A tensor leaf the writer can store: it has data and a dtype safetensors names."""
    if t.is_meta:
        raise SaveInputError(f"{what} entry {name!r} is a meta tensor (never materialized): it has no data")
    if t.is_conj() or t.is_neg():  # a lazy view: its storage holds the values before the conj or neg
        raise SaveInputError(
            f"{what} entry {name!r} is a lazy {'conjugate' if t.is_conj() else 'negative'} view: its "
            "storage does not hold its values",
            hint="save t.resolve_conj().resolve_neg() (a copy holding its values) instead",
        )
    storable = _STORABLE.get(t.dtype)
    if storable is None:
        try:
            safetensors_name(t.dtype)
            storable = True
        except DTypeError:
            storable = False
        _STORABLE[t.dtype] = storable
    if not storable:
        raise SaveInputError(
            f"{what} entry {name!r} is {t.dtype}, which safetensors cannot store",
            hint="cast it (a complex128 tensor to complex64, or its real and imaginary parts as float64)",
        )


def plain_tensor(t: torch.Tensor) -> bool:
    """The common case, tested in one expression (this runs inside the stall, once per tensor)."""
    return _STORABLE.get(t.dtype) is True and not (t.is_meta or t.is_neg() or t.is_conj())


def check_tensors(tensors: Mapping[str, torch.Tensor], what: str) -> None:
    for name, t in tensors.items():
        if not plain_tensor(t):
            check_tensor(name, t, what)
