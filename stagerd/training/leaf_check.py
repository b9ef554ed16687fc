"""What a save's leaves may be: checked in `save()`, so that a committed step always loads back.

Tensors must be dense (strided, not nested), have data (not meta), a dtype safetensors stores and the
installed safetensors reads back (the load reads every tensor through it), and a name other than the
header's own `__metadata__`. The optimizer state's other leaves are
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
import safetensors
import safetensors.torch
import torch

from stagerd.contract.dtypes import DTYPES, safetensors_name
from stagerd.contract.safetensors_format import METADATA_KEY, encode_header
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
# Not frozenset: torch's weights-only unpickler refuses it, so it takes the round trip and is refused.
_STORABLE: dict[torch.dtype, tuple[str, str] | None] = {}  # dtype -> why not and a hint; None: it can
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
    if type(value) in (tuple, list, set, torch.Size):
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


_CAST = "cast it (a complex128 tensor to complex64, or its real and imaginary parts as float64)"


def _storable(dtype: torch.dtype) -> tuple[str, str] | None:
    """Why a save cannot hold `dtype` and what to do, or None: safetensors has no name for it, or the
    installed safetensors cannot read it back (F8_E8M0 in safetensors 0.8.0), which the load does."""
    try:
        st = safetensors_name(dtype)
    except DTypeError:
        return "which safetensors cannot store", _CAST
    nbytes = DTYPES[st].nbytes(1)
    try:
        safetensors.torch.load(encode_header({"x": (st, (1,), 0, nbytes)}, {}) + bytes(nbytes))
    except Exception:
        why = f"which the installed safetensors {safetensors.__version__} cannot read back"
        return why, "upgrade safetensors, or cast it to a dtype it reads"
    return None


def check_tensor(name: str, t: torch.Tensor, what: str) -> None:
    """A tensor leaf the writer can store and the load read back: dense, with data and a dtype safetensors
    names and reads, under a name the header can hold."""
    if name == METADATA_KEY:
        raise SaveInputError(
            f"{what} entry {name!r} has the name safetensors gives its header's metadata",
            hint="rename the entry (a step saved so could not be loaded or exported)",
        )
    if t.layout != torch.strided or t.is_nested:
        kind = "nested" if t.is_nested else str(t.layout).removeprefix("torch.")
        raise SaveInputError(
            f"{what} entry {name!r} is a {kind} tensor: safetensors stores dense tensors only",
            hint="save t.to_dense() (for a nested tensor, its components or a padded tensor) instead",
        )
    if t.is_meta:
        raise SaveInputError(f"{what} entry {name!r} is a meta tensor (never materialized): it has no data")
    if t.is_conj() or t.is_neg():  # a lazy view: its storage holds the values before the conj or neg
        raise SaveInputError(
            f"{what} entry {name!r} is a lazy {'conjugate' if t.is_conj() else 'negative'} view: its "
            "storage does not hold its values",
            hint="save t.resolve_conj().resolve_neg() (a copy holding its values) instead",
        )
    if t.dtype not in _STORABLE:
        _STORABLE[t.dtype] = _storable(t.dtype)
    if (refused := _STORABLE[t.dtype]) is not None:
        raise SaveInputError(f"{what} entry {name!r} is {t.dtype}, {refused[0]}", hint=refused[1])


def plain_tensor(name: str, t: torch.Tensor) -> bool:
    """The common case, tested in one expression (this runs inside the stall, once per tensor): a leaf
    `check_tensor` would pass, else it is the one to say why."""
    return (
        name != METADATA_KEY
        and t.dtype in _STORABLE
        and _STORABLE[t.dtype] is None
        and t.layout == torch.strided
        and not (t.is_nested or t.is_meta or t.is_neg() or t.is_conj())
    )


def check_tensors(tensors: Mapping[str, torch.Tensor], what: str) -> None:
    for name, t in tensors.items():
        if not plain_tensor(name, t):
            check_tensor(name, t, what)
