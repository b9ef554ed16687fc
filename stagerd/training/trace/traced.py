"""The traced tensor: a meta tensor that carries its provenance through transformers' save-time conversion.

Each traced tensor knows which staged tensor (a root) it reads and where (a strided view of it), through
views (chunk, split, unbind, select, slicing) and value-preserving copies (contiguous, clone); a
concatenation, stack, gather of rows or zero padding of such views is held as its parts (`trace/parts.py`),
a reshape that copies a permuted view (`PermuteForRope`) as that view (`flat`), zeros a conversion makes
(`new_zeros`, `zeros_like`) as zeros. Any other op leaves a tensor that names it (`why`), which the plan
(`trace/resolve.py`) turns into a HubPlanError. Nothing is allocated: meta tensors hold no data.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map

from stagerd.training.trace import parts as trace_parts
from stagerd.training.trace.parts import Part

# Functions that return their (single) input's values in the same shape and dtype, copied.
_COPIES = frozenset({"contiguous", "clone", "detach", "to", "cpu", "requires_grad_", "detach_"})
_JOINS = frozenset({"cat", "concat", "concatenate", "stack"})
_RESHAPES = frozenset({"reshape", "flatten", "unflatten", "view", "view_as", "reshape_as"})
_PERMUTES = frozenset({"transpose", "permute", "movedim", "t", "swapaxes", "swapdims"})
# Functions whose result is all zeros, whatever their input's values.
_MAKE_ZEROS = frozenset({"new_zeros", "zeros_like"})
# Functions that fill their result with a given value: zeros, where that value is 0.
_FILLS = frozenset({"new_full", "full_like"})
# Functions whose results hold only values of their inputs: all zeros, if those are.
_KEEP_ZEROS = _COPIES | _RESHAPES | frozenset({
    "__getitem__", "chunk", "split", "tensor_split", "unbind", "narrow", "select", "squeeze", "unsqueeze",
    "transpose", "permute", "movedim", "t", "expand", "expand_as", "float", "half", "bfloat16", "double",
    "type", "type_as", "__get__",
})  # fmt: skip


class Traced(torch.Tensor):
    """A meta tensor with its provenance: `prov`, a view of a root meta tensor (a staged tensor), or
    None with `why`, the op after which it stopped being one."""

    prov: torch.Tensor | None = None
    why: str | None = None
    roots: frozenset[int] = frozenset()
    # A concatenation, stack, gather or padding of traced tensors (see trace/parts.py).
    parts: list[Part] | None = None
    # A reshape that copies (PermuteForRope's view/transpose/reshape): the strided view of a root whose
    # elements, read in its own row-major order, this tensor holds.
    flat: torch.Tensor | None = None
    zero: bool = False  # all zeros (made by new_zeros or zeros_like, or a view or copy of such)

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        flat_out, _ = tree_flatten(out)
        if not any(isinstance(o, torch.Tensor) for o in flat_out):
            return out
        traced = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, Traced)]
        if not traced:
            return out
        name = getattr(func, "__name__", repr(func))
        roots = traced[0].roots
        if name in _JOINS and isinstance(out, torch.Tensor):
            return _joined(out, name, args, kwargs, roots)
        made = name in _MAKE_ZEROS or (name in _FILLS and _fill_value(name, args, kwargs) == 0)
        if made or any(t.zero for t in traced):
            keep = made or (name in _KEEP_ZEROS and all(t.zero for t in traced))
            return _each(out, lambda t: _set(t, roots, zero=keep, why=None if keep else f"{name} of zeros"))
        first = traced[0]
        if name == "__getitem__" and len(args) > 1 and first.prov is not None:
            rows = trace_parts.gathered_index(args[1], first.dim())
            if rows is not None:
                return _gathered(first, *rows, out, roots)
        if first.flat is not None:  # a permuting reshape stays one only through copies
            keep = _copy_of(name, traced, out)
            return _each(
                out, lambda t: _set(t, roots, flat=first.flat if keep else None, why=_why(keep, name))
            )
        if first.parts is not None:  # a concatenation stays one through copies, reshapes and permutes
            parts = first.parts if _copy_of(name, traced, out) else None
            one = len(traced) == 1 and isinstance(out, torch.Tensor)
            if parts is None and name in _RESHAPES and one:
                parts = trace_parts.reshaped(first.parts, tuple(first.shape), tuple(out.shape))
            if parts is None and name in _PERMUTES and one:
                perm = _perm_of(func, first, args, kwargs)
                parts = trace_parts.permuted(first.parts, perm) if perm is not None else None
            return _each(out, lambda t: _set(t, roots, parts=parts, why=_why(parts is not None, name)))
        why = next((t.why for t in traced if t.prov is None), None)
        prov: Any = None
        if why is None:
            if _copy_of(name, traced, out):
                prov = first.prov
            else:

                def unwrap(a: Any) -> Any:
                    return a.prov if isinstance(a, Traced) else a

                with torch._C.DisableTorchFunctionSubclass():
                    prov = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))

        def wrap(o: Any, p: Any) -> Any:
            if not isinstance(o, torch.Tensor):
                return o
            base = p._base if isinstance(p, torch.Tensor) and p._base is not None else p
            ok = isinstance(p, torch.Tensor) and id(base) in roots and p.dtype == o.dtype
            t = _set(o, roots, prov=p if ok else None, why=None if ok else (why or name))
            copied = not ok and why is None and name in _RESHAPES and len(traced) == 1
            if copied and first.prov is not None and o.dtype == first.dtype and o.numel() == first.numel():
                t.flat, t.why = first.prov, None  # a copy of a view's elements, in its row-major order
            return t

        if isinstance(out, torch.Tensor):
            return wrap(out, prov)
        if isinstance(out, list | tuple):
            same = isinstance(prov, list | tuple) and len(prov) == len(out)
            provs = list(prov) if same else [None] * len(out)
            return type(out)(wrap(o, p) for o, p in zip(out, provs, strict=True))
        return out


def _perm_of(func: Any, x: Traced, args: Any, kwargs: Any) -> tuple[int, ...] | None:
    """The dim order `func` (a transpose, permute, movedim or t) gives `x`: found by applying it to a
    small tensor whose dims all differ in size, in `x`'s place."""
    probe = torch.empty(tuple(range(2, 2 + x.dim())), device="meta")

    def swap(a: Any) -> Any:
        return probe if a is x else a

    with torch._C.DisableTorchFunctionSubclass():
        out = func(*tree_map(swap, args), **tree_map(swap, kwargs))
    if not isinstance(out, torch.Tensor) or out.dim() != x.dim():
        return None
    return tuple(int(n) - 2 for n in out.shape)


def _fill_value(name: str, args: Any, kwargs: Any) -> Any:
    """The value `x.new_full(size, value)` / `torch.full_like(x, value)` fills with."""
    at = 2 if name == "new_full" else 1
    value = kwargs.get("fill_value", args[at] if len(args) > at else None)
    return value if isinstance(value, int | float) and not isinstance(value, bool) else None


def _set(
    o: torch.Tensor,
    roots: frozenset[int],
    *,
    prov: torch.Tensor | None = None,
    why: str | None = None,
    parts: list[Part] | None = None,
    flat: torch.Tensor | None = None,
    zero: bool = False,
) -> Traced:
    t = o.as_subclass(Traced)
    t.roots, t.prov, t.why, t.parts, t.flat, t.zero = roots, prov, why, parts, flat, zero
    return t


def _each(out: Any, make: Callable[[torch.Tensor], Traced]) -> Any:
    """`make` applied to `out`, a tensor, or to each tensor of a list or tuple of results."""
    if isinstance(out, torch.Tensor):
        return make(out)
    if isinstance(out, list | tuple):
        return type(out)(make(o) if isinstance(o, torch.Tensor) else o for o in out)
    return out


def _copy_of(name: str, traced: list[Traced], out: Any) -> bool:
    """`out` is a copy of the one traced input's values, in its shape and dtype."""
    first = traced[0]
    return (
        name in _COPIES
        and len(traced) == 1
        and isinstance(out, torch.Tensor)
        and out.dtype == first.dtype
        and out.shape == first.shape
    )


def _why(keep: bool, name: str) -> str | None:
    return None if keep else f"{name} of a concatenation or permuted reshape"


def _own(x: Any) -> list[Part] | None:
    """The parts a traced tensor is, or None if it is not one the plan can hold."""
    if not isinstance(x, Traced):
        return None
    shape = tuple(x.shape)
    if x.zero:
        return [trace_parts.zeros((0,) * len(shape), shape)]
    if x.parts is not None:
        return x.parts
    if x.flat is not None:
        return [(x.flat, (0,) * len(shape), shape)]
    if x.prov is not None:
        return [(x.prov, (0,) * len(shape), None)]
    return None


def _joined(out: torch.Tensor, name: str, args: Any, kwargs: Any, roots: frozenset[int]) -> Traced:
    """`torch.cat` / `torch.stack` of traced tensors: its parts, each a view of a root at its offset."""
    tensors = args[0] if args else kwargs.get("tensors", [])
    dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    owns = []
    for x in tensors:
        own = _own(x)
        if own is None:
            return _set(out, roots, why=(x.why if isinstance(x, Traced) and x.why else name))
        owns.append((own, tuple(x.shape)))
    parts = trace_parts.joined(owns, dim % out.dim(), name == "stack")
    return _set(out, roots, parts=parts)


def _gathered(x: Traced, dim: int, rows: list[int], out: torch.Tensor, roots: frozenset[int]) -> Traced:
    """`x[..., [i, j, ...], ...]`: the rows, each a view of `x`, concatenated along `dim`."""
    assert x.prov is not None
    n = x.shape[dim]
    if any(not -n <= r < n for r in rows):
        return _set(out, roots, why="__getitem__")
    with torch._C.DisableTorchFunctionSubclass():
        views = [x.prov.narrow(dim, r % n, 1) for r in rows]
    parts = trace_parts.joined([([(v, (0,) * v.dim(), None)], tuple(v.shape)) for v in views], dim, False)
    return _set(out, roots, parts=parts)
