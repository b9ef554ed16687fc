"""A trainer's nested state (optimizer, scheduler, loops, callbacks, hyper-parameters) as tensors plus JSON.

Trainers keep their checkpoint as one nested Python object and save it with `torch.save`, so loading it
is an unpickle. Here the tensors go to DCP under path keys (`split`) and everything else becomes a JSON
skeleton that names each tensor by its key; `join` rebuilds the object from the two. Loading never
unpickles anything: the skeleton is JSON, and the tensors are read by DCP as tensors.

The skeleton is plain JSON where the value is (a dict with string keys, a list, a string, a finite float,
an int, a bool, None); anything JSON cannot say is a tagged object `{"__stagerd__": kind, ...}`: a tensor
(`key`, `dtype`, `shape`), a tuple, a dict with other keys (or holding the tag's own name), a float that is
not finite, a `torch.dtype`. Any other type is a `SaveInputError` naming its path, at save time: a value
this cannot restore exactly is refused instead of being saved wrong.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch

from stagerd.errors import LoadError, SaveInputError

TAG = "__stagerd__"
ENCODING = "stagerd.state_tree/1"
_TOO_DEEP = "the saved trainer state is nested too deep to rebuild"
_TOO_DEEP_HINT = (
    "the step's trainer state was not written by stagerd's split; load another step; nothing was loaded"
)


def _escape(part: str) -> str:
    return part.replace("~", "~0").replace("/", "~1")


def split(tree: Any, prefix: str) -> tuple[dict[str, torch.Tensor], Any]:
    """The tensors of `tree` by path key (each under `prefix/`), and its JSON skeleton."""
    tensors: dict[str, torch.Tensor] = {}

    def enc(v: Any, path: str) -> Any:
        if isinstance(v, torch.Tensor):
            tensors[path] = v
            return {TAG: "tensor", "key": path, "dtype": dtype_name(v.dtype), "shape": list(v.shape)}
        if v is None or isinstance(v, bool | str):
            return v
        if isinstance(v, int):
            return int(v)  # an IntEnum or a numpy-free int subclass: its value
        if isinstance(v, float):
            return float(v) if math.isfinite(v) else {TAG: "float", "value": repr(float(v))}
        if isinstance(v, torch.dtype):
            return {TAG: "dtype", "name": dtype_name(v)}
        if isinstance(v, Mapping):
            items = [(k, enc(x, f"{path}/{_escape(str(k))}")) for k, x in v.items()]
            if all(isinstance(k, str) for k, _ in items) and TAG not in v:
                return dict(items)
            for k, _ in items:
                if k is not None and not isinstance(k, str | int | float | bool):
                    raise SaveInputError(f"{path}: a dict key of type {type(k).__name__} cannot be saved")
            return {TAG: "dict", "items": [[k, x] for k, x in items]}
        if isinstance(v, list | tuple):
            out = [enc(x, f"{path}/{i}") for i, x in enumerate(v)]
            return out if isinstance(v, list) else {TAG: "tuple", "items": out}
        raise SaveInputError(
            f"{path}: a {type(v).__module__}.{type(v).__qualname__} cannot be saved as checkpoint state",
            hint="keep the trainer's state to tensors, numbers, strings, lists and dicts "
            "(hyper-parameters too); stagerd never pickles",
        )

    try:
        skeleton = enc(tree, prefix)
    except RecursionError:
        raise SaveInputError(
            f"{prefix}: the checkpoint state is nested too deep to save",
            hint="keep the trainer's state a few hundred levels deep at most; nothing was saved",
        ) from None
    return tensors, skeleton


def join(skeleton: Any, tensor: Callable[[str], torch.Tensor]) -> Any:
    """The object `split` took apart; `tensor(key)` gives each loaded tensor. LoadError on a malformed
    skeleton (it came from disk)."""

    def dec(v: Any) -> Any:
        if isinstance(v, list):
            return [dec(x) for x in v]
        if not isinstance(v, dict):
            return v
        kind = v.get(TAG)
        if kind is None:
            return {k: dec(x) for k, x in v.items()}
        if kind == "tensor":
            return tensor(_str(v["key"]))
        if kind == "tuple":
            return tuple(dec(x) for x in v["items"])
        if kind == "dict":
            return {k: dec(x) for k, x in v["items"]}
        if kind == "float":
            return float(_str(v["value"]))
        if kind == "dtype":
            return parse_dtype(v["name"])
        raise LoadError(f"unknown {TAG} kind {kind!r} in saved trainer state")

    try:
        return dec(skeleton)
    except (KeyError, TypeError, ValueError) as e:
        raise LoadError(f"malformed saved trainer state: {type(e).__name__}: {e}") from None
    except RecursionError:
        raise LoadError(_TOO_DEEP, hint=_TOO_DEEP_HINT) from None


def tensor_specs(skeleton: Any) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """Every tensor the skeleton names: key -> (dtype, shape), for building load templates."""
    out: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}

    def walk(v: Any) -> None:
        if isinstance(v, list):
            for x in v:
                walk(x)
        elif isinstance(v, dict):
            if v.get(TAG) == "tensor":
                try:
                    out[_str(v["key"])] = (parse_dtype(v["dtype"]), tuple(int(n) for n in v["shape"]))
                except (KeyError, TypeError, ValueError) as e:
                    raise LoadError(f"malformed tensor entry in saved trainer state: {e!r}") from None
                return
            for x in v.values():
                walk(x)

    try:
        walk(skeleton)
    except RecursionError:
        raise LoadError(_TOO_DEEP, hint=_TOO_DEEP_HINT) from None
    return out


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: Any) -> torch.dtype:
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise LoadError(f"saved trainer state names an unknown dtype {name!r}")
    return dtype


def to_blob(obj: Any) -> torch.Tensor:
    """JSON as a uint8 tensor: non-tensor state rides in DCP's `optim/` without a pickle."""
    data = json.dumps(obj, separators=(",", ":"), allow_nan=False).encode()
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def from_blob(t: torch.Tensor, what: str) -> Any:
    try:
        return json.loads(bytes(t.numpy()))
    except (ValueError, UnicodeDecodeError) as e:
        raise LoadError(f"{what} is not JSON: {e}") from None
    except RecursionError:
        raise LoadError(f"{what} is JSON nested too deep to read", hint=_TOO_DEEP_HINT) from None


def _str(v: Any) -> str:
    if not isinstance(v, str):
        raise TypeError(f"expected a string, got {type(v).__name__}")
    return v
