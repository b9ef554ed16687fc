"""Resolve the to-Hub plan of a transformers model at save time, from transformers' own code.

`save_pretrained` drops tied duplicates (`remove_tied_weights_from_state_dict`) and then runs the model's
conversion registry backwards (`revert_weight_conversion`: renames, `MergeModulelist` -> split,
`Concatenate` -> `Chunk`, ...). Both run here, unchanged, on meta tensors that carry their provenance: each
traced tensor knows which staged tensor it reads and where (a strided view of it), through views (chunk,
split, unbind, select, slicing) and value-preserving copies (contiguous, clone). Each output is then a box
of one staged tensor: a `TensorView` of the declarative plan the export engine carries out as byte moves.

A concatenation or stack of such views is planned as the parts of one output (`trace/parts.py`), a
transpose as a permutation of the box's dims, and a reshape that copies a permuted view (`PermuteForRope`'s
view/transpose/reshape: rows regrouped per head) as a permuted view of the box it reads (`trace/boxes.py`).
Zeros a conversion makes (`new_zeros`, `zeros_like`: the padding `Inkling2UnpadVocab` appends on save) are
zero fills of the plan; rows picked by a list (`tensor[:, [0, 3]]`) are a concatenation of the rows; a
reshape of a concatenation is planned as runs of its rows. Anything else (a flip, arithmetic, a dtype
change of a saved tensor) is a HubPlanError naming the op, at save time: never a silently different export.
Nothing is allocated: meta tensors hold no data.
"""

from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map

from stagerd.contract.dtypes import safetensors_name
from stagerd.contract.hub_plan import HubPlan, SharedStorage, TensorView, ZeroFill
from stagerd.errors import HubPlanError
from stagerd.training.trace import parts as trace_parts
from stagerd.training.trace.boxes import box_of, flat_box
from stagerd.training.trace.parts import Part
from stagerd.training.trace.storages import StorageKey, kept_storages

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


class _Traced(torch.Tensor):
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
        traced = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, _Traced)]
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
                    return a.prov if isinstance(a, _Traced) else a

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


def _perm_of(func: Any, x: _Traced, args: Any, kwargs: Any) -> tuple[int, ...] | None:
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
) -> _Traced:
    t = o.as_subclass(_Traced)
    t.roots, t.prov, t.why, t.parts, t.flat, t.zero = roots, prov, why, parts, flat, zero
    return t


def _each(out: Any, make: Callable[[torch.Tensor], _Traced]) -> Any:
    """`make` applied to `out`, a tensor, or to each tensor of a list or tuple of results."""
    if isinstance(out, torch.Tensor):
        return make(out)
    if isinstance(out, list | tuple):
        return type(out)(make(o) if isinstance(o, torch.Tensor) else o for o in out)
    return out


def _copy_of(name: str, traced: list[_Traced], out: Any) -> bool:
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
    if not isinstance(x, _Traced):
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


def _joined(out: torch.Tensor, name: str, args: Any, kwargs: Any, roots: frozenset[int]) -> _Traced:
    """`torch.cat` / `torch.stack` of traced tensors: its parts, each a view of a root at its offset."""
    tensors = args[0] if args else kwargs.get("tensors", [])
    dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    owns = []
    for x in tensors:
        own = _own(x)
        if own is None:
            return _set(out, roots, why=(x.why if isinstance(x, _Traced) and x.why else name))
        owns.append((own, tuple(x.shape)))
    parts = trace_parts.joined(owns, dim % out.dim(), name == "stack")
    return _set(out, roots, parts=parts)


def _gathered(x: _Traced, dim: int, rows: list[int], out: torch.Tensor, roots: frozenset[int]) -> _Traced:
    """`x[..., [i, j, ...], ...]`: the rows, each a view of `x`, concatenated along `dim`."""
    assert x.prov is not None
    n = x.shape[dim]
    if any(not -n <= r < n for r in rows):
        return _set(out, roots, why="__getitem__")
    with torch._C.DisableTorchFunctionSubclass():
        views = [x.prov.narrow(dim, r % n, 1) for r in rows]
    parts = trace_parts.joined([([(v, (0,) * v.dim(), None)], tuple(v.shape)) for v in views], dim, False)
    return _set(out, roots, parts=parts)


def is_transformers_model(model: Any) -> bool:
    tf = sys.modules.get("transformers")
    return tf is not None and isinstance(model, tf.PreTrainedModel)


def traced_plan(
    sd: Mapping[str, torch.Tensor],
    aliases: Mapping[str, str],
    convert: Callable[[dict[str, torch.Tensor]], Mapping[str, Any]],
    origin: str,
    *,
    keys: Sequence[str] = (),
    parameters: int | None = None,
    storages: Mapping[str, tuple[StorageKey, int]] | None = None,
) -> HubPlan:
    """Run `convert` (a library's own save-time conversion) on traced meta tensors standing for the staged
    `sd` (plus its `aliases`, the same tensor under each key) and turn what it returns into a plan.
    `keys`: the order the library's own state dict walks them, which its splitter fills files in;
    `parameters`: its num_parameters(), for the index; `storages`: the real storages its splitter sizes
    some of them by (`storages.kept_storages`)."""
    roots = {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in sd.items()}
    root_ids = frozenset(id(r) for r in roots.values())
    source_of = {id(r): k for k, r in roots.items()}
    traced: dict[str, _Traced] = {}
    for k, r in roots.items():
        t = torch.empty(r.shape, dtype=r.dtype, device="meta").as_subclass(_Traced)
        t.prov, t.roots = r, root_ids
        traced[k] = t
    staged = [*sd, *aliases]
    known = set(staged)
    walk = [k for k in keys if k in known]
    walk += [k for k in staged if k not in set(walk)]
    meta: dict[str, torch.Tensor] = {k: traced[aliases.get(k, k)] for k in walk}
    # each traced tensor's meta storage -> the real one it stands for, where that is not its own
    real = {
        traced[aliases.get(k, k)].untyped_storage()._cdata: s
        for k, s in (storages or {}).items()
        if k in known
    }
    try:
        reverted = convert(meta)
    except Exception as e:
        raise HubPlanError(f"the {origin} conversion failed: {type(e).__name__}: {e}") from None
    views: list[TensorView] = []
    zeros: list[ZeroFill] = []

    def zero_view(name: str, dtype: torch.dtype, shape: tuple[int, ...], **at: Any) -> TensorView:
        z = ZeroFill(f"{name}{ZERO_SUFFIX}{len(zeros)}", safetensors_name(dtype), shape)
        zeros.append(z)
        return TensorView(name, z.name, (0,) * len(shape), shape, shape, **at)

    for name, o in reverted.items():
        if isinstance(o, _Traced) and (o.zero or o.numel() == 0):
            views.append(zero_view(name, o.dtype, tuple(o.shape)))
            continue
        parts = o.parts if isinstance(o, _Traced) else None
        if isinstance(o, _Traced) and o.flat is not None:
            try:
                views.append(flat_box(name, o.flat, tuple(o.shape), source_of, origin))
                continue
            except HubPlanError:  # not a permuted box: row by row, if that is few enough pieces
                own = [(o.flat, (0,) * o.flat.dim(), None)]
                parts = trace_parts.reshaped(own, tuple(o.flat.shape), tuple(o.shape))
                if parts is None:
                    raise
        if isinstance(o, _Traced) and parts is not None:
            whole = tuple(o.shape)
            parts = [p for p in parts if math.prod(trace_parts.part_shape(p))]
            single = len(parts) == 1 and trace_parts.part_shape(parts[0]) == whole
            for part, at, flat in parts:
                place: dict[str, Any] = {} if single else {"at": at, "whole": whole}
                if part is None:
                    views.append(zero_view(name, o.dtype, trace_parts.part_shape((part, at, flat)), **place))
                    continue
                v = (
                    box_of(name, part, source_of, origin)
                    if flat is None
                    else flat_box(name, part, flat, source_of, origin)
                )
                views.append(replace(v, **place))
            continue
        p = o.prov if isinstance(o, _Traced) else None
        if p is None:
            why = o.why if isinstance(o, _Traced) else type(o).__name__
            raise HubPlanError(
                f"{name!r}: the {origin} conversion to the checkpoint layout uses {why!r}, which is not a "
                "box of one saved tensor and cannot be planned as byte moves"
            )
        views.append(box_of(name, p, source_of, origin))
    read = {v.source for v in views if not (v.name == v.source and v.is_whole(tuple(sd[v.source].shape)))}
    kept = [v for v in views if v.source in read or v.name != v.source]
    written = {v.source for v in views}
    plan = HubPlan(
        tuple(kept),
        tuple(k for k in sd if k not in written),
        origin=origin,
        zeros=tuple(zeros),
        order=tuple(reverted),
        shared=_shared_storages(reverted, real),
        parameters=parameters,
    )
    plan.outputs({**{k: tuple(v.shape) for k, v in sd.items()}, **{z.name: z.shape for z in zeros}})
    return plan


def _shared_storages(
    reverted: Mapping[str, Any], real: Mapping[int, tuple[StorageKey, int]]
) -> tuple[SharedStorage, ...]:
    """Outputs that are views of one storage (a split's parts), or of part of one: the splitter sizes a
    tensor by its whole storage and keeps the tensors of one storage in one file. A traced tensor's
    storage is the `real` one it stands for, where the model's is not its own (a flat buffer's)."""
    names: dict[Hashable, list[str]] = {}
    numel: dict[Hashable, int] = {}
    for name, o in reverted.items():
        if isinstance(o, torch.Tensor) and o.element_size():
            storage = o.untyped_storage()
            key, nbytes = real.get(storage._cdata, (storage._cdata, storage.nbytes()))
            names.setdefault(key, []).append(name)
            numel[key] = nbytes // o.element_size()
    return tuple(
        SharedStorage(tuple(ns), numel[key])
        for key, ns in names.items()
        if len(ns) > 1 or numel[key] != reverted[ns[0]].numel()
    )


# A zero fill is named after the output it pads: "<output>#zeros<n>", never a name a model saves.
ZERO_SUFFIX = "#zeros"


def transformers_plan(
    model: Any,
    sd: Mapping[str, torch.Tensor],
    aliases: Mapping[str, str],
    *,
    keys: Sequence[str] | None = None,
    parameters: int | None = None,
) -> HubPlan:
    """The plan that makes the staged `sd` (aliases removed) what `model.save_pretrained` writes. `keys`
    and `parameters`: the state-dict order and num_parameters() of the model that is saved, where that is
    not `model` itself (a LoRA model's `merge_and_unload()`)."""
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    def convert(meta: dict[str, torch.Tensor]) -> Mapping[str, Any]:
        with _transformers_classes(model):
            return revert_weight_conversion(model, remove_tied_weights_from_state_dict(meta, model))

    # save_pretrained walks model.state_dict() and writes num_parameters() into its index
    storages = None
    if keys is None:
        own = model.state_dict(keep_vars=True)
        keys, storages = list(own), kept_storages(own)
    if parameters is None:
        parameters = model.num_parameters()
    return traced_plan(
        sd, aliases, convert, "transformers", keys=keys, parameters=parameters, storages=storages
    )


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
