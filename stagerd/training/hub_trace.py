"""Resolve the to-Hub plan of a transformers model at save time, from transformers' own code.

`save_pretrained` drops tied duplicates (`remove_tied_weights_from_state_dict`) and then runs the model's
conversion registry backwards (`revert_weight_conversion`: renames, `MergeModulelist` -> split,
`Concatenate` -> `Chunk`, ...). Both run here, unchanged, on meta tensors that carry their provenance: each
traced tensor knows which staged tensor it reads and where (a strided view of it), through views (chunk,
split, unbind, select, slicing) and value-preserving copies (contiguous, clone). Each output is then a box
of one staged tensor: a `TensorView` of the declarative plan the export engine carries out as byte moves.

A concatenation or stack of such views is planned as the parts of one output, a transpose as a
permutation of the box's dims, and a reshape that copies a permuted view (`PermuteForRope`'s
view/transpose/reshape: rows regrouped per head) as a permuted view of the box it reads. Anything else (a
flip, a dtype change, further ops on such a copy) is a HubPlanError naming the op, at save time:
never a silently different export.
Nothing is allocated: meta tensors hold no data.
"""

from __future__ import annotations

import contextlib
import itertools
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import replace
from typing import Any, cast

import torch
from torch.utils._pytree import tree_flatten, tree_map

from stagerd.contract.hub_plan import HubPlan, TensorView
from stagerd.errors import HubPlanError

# Functions that return their (single) input's values in the same shape and dtype, copied.
_COPIES = frozenset({"contiguous", "clone", "detach", "to", "cpu", "requires_grad_", "detach_"})


class _Traced(torch.Tensor):
    """A meta tensor with its provenance: `prov`, a view of a root meta tensor (a staged tensor), or
    None with `why`, the op after which it stopped being one."""

    prov: torch.Tensor | None = None
    why: str | None = None
    roots: frozenset[int] = frozenset()
    # A concatenation or stack of traced tensors: (view of a root, offset in this tensor, and for a
    # permuted reshape the part's shape, its values the view's in row-major order) per part.
    parts: list[tuple[torch.Tensor, tuple[int, ...], tuple[int, ...] | None]] | None = None
    # A reshape that copies (PermuteForRope's view/transpose/reshape): the strided view of a root whose
    # elements, read in its own row-major order, this tensor holds.
    flat: torch.Tensor | None = None

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        flat_out, _ = tree_flatten(out)
        if not any(isinstance(o, torch.Tensor) for o in flat_out):
            return out
        traced = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, _Traced)]
        if not traced:
            return out
        name = getattr(func, "__name__", repr(func))
        roots = traced[0].roots
        if name in _JOINS and isinstance(out, torch.Tensor):
            return _joined(out, name, args, kwargs, roots)
        first = traced[0]
        if first.flat is not None:  # a permuting reshape stays one only through copies
            t = out.as_subclass(_Traced) if isinstance(out, torch.Tensor) else None
            if t is None:
                return out
            keep = (
                name in _COPIES and len(traced) == 1 and out.dtype == first.dtype and out.shape == first.shape
            )
            t.roots, t.flat, t.prov = roots, (first.flat if keep else None), None
            t.why = None if keep else f"{name} of a permuted reshape"
            return t
        if first.parts is not None:  # a concatenation stays one only through copies
            t = out.as_subclass(_Traced) if isinstance(out, torch.Tensor) else None
            if t is None:
                return out
            keep = (
                name in _COPIES and len(traced) == 1 and out.dtype == first.dtype and out.shape == first.shape
            )
            t.roots, t.parts = roots, (first.parts if keep else None)
            t.prov, t.why = None, (None if keep else f"{name} of a concatenation")
            return t
        why = next((t.why for t in traced if t.prov is None), None)
        prov: Any = None
        if why is None:
            if (
                name in _COPIES
                and len(traced) == 1
                and isinstance(out, torch.Tensor)
                and out.dtype == first.dtype
                and out.shape == first.shape
            ):
                prov = first.prov
            else:

                def unwrap(a: Any) -> Any:
                    return a.prov if isinstance(a, _Traced) else a

                with torch._C.DisableTorchFunctionSubclass():
                    prov = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))

        def wrap(o: Any, p: Any) -> Any:
            if not isinstance(o, torch.Tensor):
                return o
            t = o.as_subclass(_Traced)
            base = p._base if isinstance(p, torch.Tensor) and p._base is not None else p
            ok = isinstance(p, torch.Tensor) and id(base) in roots and p.dtype == o.dtype
            t.prov, t.why, t.roots = (p if ok else None), (None if ok else (why or name)), roots
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


_JOINS = frozenset({"cat", "concat", "concatenate", "stack"})
_RESHAPES = frozenset({"reshape", "flatten", "view", "view_as", "reshape_as"})


def _joined(out: torch.Tensor, name: str, args: Any, kwargs: Any, roots: frozenset[int]) -> _Traced:
    """`torch.cat` / `torch.stack` of traced tensors: its parts, each a view of a root at its offset."""
    tensors = args[0] if args else kwargs.get("tensors", [])
    dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    t = out.as_subclass(_Traced)
    t.roots, t.prov, t.why, t.parts = roots, None, None, []
    dim %= out.dim()
    at = 0
    for x in tensors:
        if not isinstance(x, _Traced) or (x.prov is None and x.parts is None and x.flat is None):
            t.parts, t.why = None, (x.why if isinstance(x, _Traced) and x.why else name)
            return t
        own: list[tuple[torch.Tensor, tuple[int, ...], tuple[int, ...] | None]]
        if x.parts is not None:
            own = x.parts
        elif x.flat is not None:
            own = [(x.flat, (0,) * x.dim(), tuple(x.shape))]
        else:
            own = [(cast("torch.Tensor", x.prov), (0,) * x.dim(), None)]
        for p, off, flat in own:
            with torch._C.DisableTorchFunctionSubclass():
                q = p.unsqueeze(dim) if name == "stack" and flat is None else p
            if flat is not None and name == "stack":
                flat = (*flat[:dim], 1, *flat[dim:])
            pos = list(off) if name != "stack" else [*off[:dim], 0, *off[dim:]]
            pos[dim] += at
            t.parts.append((q, tuple(pos), flat))
        at += 1 if name == "stack" else x.shape[dim]
    return t


def _strides(shape: tuple[int, ...]) -> list[int]:
    out = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        out[d] = out[d + 1] * shape[d + 1]
    return out


def _view(name: str, source: str, p: torch.Tensor, root_shape: tuple[int, ...]) -> TensorView | None:
    """`p` (a view of the root) as a box of it read in row-major order, or None if it is not one."""
    rs = _strides(root_shape)
    rem, start = p.storage_offset(), []
    for d, n in enumerate(root_shape):
        start.append((rem // rs[d]) % n if n else 0)
    if sum(a * s for a, s in zip(start, rs, strict=True)) != p.storage_offset():
        return None
    size = [1] * len(root_shape)
    order: list[int] = []  # the root dim of each non-unit dim of `p`
    for n, st in zip(p.shape, p.stride(), strict=True):
        if n == 1:
            continue
        found = next((d for d in range(len(root_shape)) if root_shape[d] > 1 and rs[d] == st), None)
        if found is None or found in order or start[found] + n > root_shape[found]:
            return None
        size[found] = n
        order.append(found)
    if order == sorted(order):
        return TensorView(name, source, tuple(start), tuple(size), tuple(p.shape))
    # The box's dims permuted (a Transpose): moved by source lines, see engine/views.py.
    dims = sorted(order)
    reshape, perm = tuple(size[d] for d in dims), tuple(dims.index(d) for d in order)
    return TensorView(name, source, tuple(start), tuple(size), tuple(p.shape), reshape, perm)


def is_transformers_model(model: Any) -> bool:
    tf = sys.modules.get("transformers")
    return tf is not None and isinstance(model, tf.PreTrainedModel)


def traced_plan(
    sd: Mapping[str, torch.Tensor],
    aliases: Mapping[str, str],
    convert: Callable[[dict[str, torch.Tensor]], Mapping[str, Any]],
    origin: str,
) -> HubPlan:
    """Run `convert` (a library's own save-time conversion) on traced meta tensors standing for the staged
    `sd` (plus its `aliases`, the same tensor under each key) and turn what it returns into a plan."""
    roots = {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in sd.items()}
    root_ids = frozenset(id(r) for r in roots.values())
    source_of = {id(r): k for k, r in roots.items()}
    traced: dict[str, _Traced] = {}
    for k, r in roots.items():
        t = torch.empty(r.shape, dtype=r.dtype, device="meta").as_subclass(_Traced)
        t.prov, t.roots = r, root_ids
        traced[k] = t
    meta: dict[str, torch.Tensor] = {k: traced[aliases.get(k, k)] for k in [*sd, *aliases]}
    try:
        reverted = convert(meta)
    except Exception as e:
        raise HubPlanError(f"the {origin} conversion failed: {type(e).__name__}: {e}") from None
    views: list[TensorView] = []
    for name, o in reverted.items():
        if isinstance(o, _Traced) and o.parts is not None:
            for part, at, flat in o.parts:
                v = (
                    _box_of(name, part, source_of, origin)
                    if flat is None
                    else _flat_box(name, part, flat, source_of, origin)
                )
                views.append(replace(v, at=at, whole=tuple(o.shape)))
            continue
        if isinstance(o, _Traced) and o.flat is not None:
            views.append(_flat_box(name, o.flat, tuple(o.shape), source_of, origin))
            continue
        p = o.prov if isinstance(o, _Traced) else None
        if p is None:
            why = o.why if isinstance(o, _Traced) else type(o).__name__
            raise HubPlanError(
                f"{name!r}: the {origin} conversion to the checkpoint layout uses {why!r}, which is not a "
                "box of one saved tensor and cannot be planned as byte moves"
            )
        views.append(_box_of(name, p, source_of, origin))
    read = {v.source for v in views if not (v.name == v.source and v.is_whole(tuple(sd[v.source].shape)))}
    kept = [v for v in views if v.source in read or v.name != v.source]
    written = {v.source for v in views}
    return HubPlan(tuple(kept), tuple(k for k in sd if k not in written), origin=origin)


def _box_of(name: str, p: torch.Tensor, source_of: Mapping[int, str], origin: str) -> TensorView:
    base = p._base if p._base is not None else p
    source = source_of[id(base)]
    v = _view(name, source, p, tuple(base.shape))
    if v is None:
        raise HubPlanError(
            f"{name!r}: the {origin} conversion reorders the elements of {source!r} (shape "
            f"{list(p.shape)}, strides {list(p.stride())}): not a box, cannot be planned as byte moves"
        )
    return v


def _flat_box(
    name: str, p: torch.Tensor, shape: tuple[int, ...], source_of: Mapping[int, str], origin: str
) -> TensorView:
    """Output `name` of `shape`: the elements of `p` (a strided view of a root) in `p`'s row-major order.
    Planned where `p`'s dims, ordered by stride, tile a contiguous range of the root that is a box of it
    (whole trailing rows): the box read in row-major order, viewed as those dims (`reshape`), permuted back
    to `p`'s order (`perm`). PermuteForRope's rows regrouped per head are this."""
    base = p._base if p._base is not None else p
    source, root = source_of[id(base)], tuple(base.shape)
    st = [int(x) for x in p.stride()]
    dims = sorted((d for d in range(p.dim()) if p.shape[d] != 1), key=lambda d: -st[d])
    ok = bool(dims) and st[dims[-1]] == 1
    for a, b in itertools.pairwise(dims):
        ok = ok and st[a] == st[b] * p.shape[b]
    box = _range_box(int(p.storage_offset()), p.numel(), root) if ok else None
    if box is None:
        raise HubPlanError(
            f"{name!r}: the {origin} conversion reshapes {source!r} (shape {list(p.shape)}, strides "
            f"{list(p.stride())}) into an order that is not a permutation of a box: cannot be planned"
        )
    start, size = box
    reshape = tuple(p.shape[d] for d in dims)
    perm = tuple(dims.index(d) for d in range(p.dim()) if p.shape[d] != 1)
    if perm == tuple(range(len(perm))):
        reshape, perm = (), ()
        if [k for k in size if k != 1] != [k for k in shape if k != 1]:
            raise HubPlanError(f"{name!r}: a reshape of {source!r} that is not its box: cannot be planned")
    return TensorView(name, source, start, size, shape, reshape, perm)


def _range_box(off: int, n: int, root: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """The box of `root` that is the row-major range [off, off + n), if one is."""
    rs = _strides(root)
    for k in range(len(root)):
        if n % rs[k] or off % rs[k]:
            continue
        m = n // rs[k]
        start = [(off // rs[d]) % root[d] for d in range(len(root))]
        if start[k] + m <= root[k] and all(start[d] == 0 for d in range(k + 1, len(root))):
            return tuple(start), tuple([*(1 for _ in range(k)), m, *root[k + 1 :]])
    return None


def transformers_plan(model: Any, sd: Mapping[str, torch.Tensor], aliases: Mapping[str, str]) -> HubPlan:
    """The plan that makes the staged `sd` (aliases removed) what `model.save_pretrained` writes."""
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    def convert(meta: dict[str, torch.Tensor]) -> Mapping[str, Any]:
        with _transformers_classes(model):
            return revert_weight_conversion(model, remove_tied_weights_from_state_dict(meta, model))

    return traced_plan(sd, aliases, convert, "transformers")


@contextlib.contextmanager
def _transformers_classes(model: Any) -> Iterator[None]:
    """FSDP2's `fully_shard` gives a module a class of its own (`FSDP<Name>`, defined in torch), which
    transformers takes for custom code and so skips its registry entry (`get_model_conversion_mapping`
    looks sub-models up by class name and module): while the conversion is resolved, each such model has
    its transformers class back. Nothing runs on the model meanwhile."""
    swapped = []
    for m in model.modules():
        cls = type(m)
        if cls.__module__.startswith("transformers."):
            continue
        orig = next((c for c in cls.__mro__[1:] if c.__module__.startswith("transformers.")), None)
        if orig is not None and cls.__name__ == f"FSDP{orig.__name__}":
            swapped.append((m, cls))
            m.__class__ = orig
    try:
        yield
    finally:
        for m, cls in swapped:
            m.__class__ = cls


def alias_plan(sd: Mapping[str, torch.Tensor], aliases: Mapping[str, str]) -> HubPlan | None:
    """For a model not from transformers: every aliased key is written, with its own copy of the bytes."""
    if not aliases:
        return None
    views = []
    for k in dict.fromkeys(aliases.values()):
        shape = tuple(sd[k].shape)
        views.append(TensorView(k, k, (0,) * len(shape), shape, shape))
    for dup, k in aliases.items():
        shape = tuple(sd[k].shape)
        views.append(TensorView(dup, k, (0,) * len(shape), shape, shape))
    return HubPlan(tuple(views), (), origin="aliases")
