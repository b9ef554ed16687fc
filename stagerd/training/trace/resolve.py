"""Resolve the to-Hub plan of a transformers model at save time, from transformers' own code.

`save_pretrained` drops tied duplicates (`remove_tied_weights_from_state_dict`) and then runs the model's
conversion registry backwards (`revert_weight_conversion`: renames, `MergeModulelist` -> split,
`Concatenate` -> `Chunk`, ...). Both run here, unchanged, on meta tensors that carry their provenance
(`trace/traced.py`): each traced tensor knows which staged tensor it reads and where (a strided view of
it), through views (chunk, split, unbind, select, slicing) and value-preserving copies (contiguous, clone).
Each output is then a box of one staged tensor: a `TensorView` of the declarative plan the export engine
carries out as byte moves.

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

from stagerd.contract.dtypes import safetensors_name
from stagerd.contract.hub_plan import Holds, HubPlan, SharedStorage, TensorView, ZeroFill
from stagerd.errors import HubPlanError
from stagerd.training.trace import fp32_modules
from stagerd.training.trace import parts as trace_parts
from stagerd.training.trace.boxes import box_of, flat_box
from stagerd.training.trace.storages import StorageKey, kept_storages
from stagerd.training.trace.traced import Traced


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
    traced: dict[str, Traced] = {}
    for k, r in roots.items():
        t = torch.empty(r.shape, dtype=r.dtype, device="meta").as_subclass(Traced)
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
        if isinstance(o, Traced) and (o.zero or o.numel() == 0):
            views.append(zero_view(name, o.dtype, tuple(o.shape)))
            continue
        parts = o.parts if isinstance(o, Traced) else None
        if isinstance(o, Traced) and o.flat is not None:
            try:
                views.append(flat_box(name, o.flat, tuple(o.shape), source_of, origin))
                continue
            except HubPlanError:  # not a permuted box: row by row, if that is few enough pieces
                own = [(o.flat, (0,) * o.flat.dim(), None)]
                parts = trace_parts.reshaped(own, tuple(o.flat.shape), tuple(o.shape))
                if parts is None:
                    raise
        if isinstance(o, Traced) and parts is not None:
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
        p = o.prov if isinstance(o, Traced) else None
        if p is None:
            why = o.why if isinstance(o, Traced) else type(o).__name__
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
    tensor by its whole storage and keeps the tensors of one storage in one file. Where the model's storage
    is not a tensor's own (a flat buffer's: `real`), that holds only while the dtype is kept: a cast
    (`model.to(dtype)`) gives each parameter a storage of its own, and then the traced tensors' own
    storages (a split's views stay one) are what holds. Each group is marked with when it holds."""
    kept, cast = _storage_groups(reverted, real), _storage_groups(reverted, {})
    both = set(kept) & set(cast)
    return (
        *(replace(g, holds=Holds.ALWAYS if g in both else Holds.KEPT) for g in kept),
        *(replace(g, holds=Holds.CAST) for g in cast if g not in both),
    )


def _storage_groups(
    reverted: Mapping[str, Any], real: Mapping[int, tuple[StorageKey, int]]
) -> list[SharedStorage]:
    """The groups of outputs by storage: a traced tensor's storage is the `real` one it stands for, where
    `real` names it, else its own."""
    names: dict[Hashable, list[str]] = {}
    numel: dict[Hashable, int] = {}
    for name, o in reverted.items():
        if isinstance(o, torch.Tensor) and o.element_size():
            storage = o.untyped_storage()
            key, nbytes = real.get(storage._cdata, (storage._cdata, storage.nbytes()))
            names.setdefault(key, []).append(name)
            numel[key] = nbytes // o.element_size()
    return [
        SharedStorage(tuple(ns), numel[key])
        for key, ns in names.items()
        if len(ns) > 1 or numel[key] != reverted[ns[0]].numel()
    ]


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
    """The plan that makes the staged `sd` (aliases removed) what `model.save_pretrained` writes (after a
    cast, of the model loaded in that dtype: what it keeps in float32 is left uncast). `keys`
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
    plan = traced_plan(
        sd, aliases, convert, "transformers", keys=keys, parameters=parameters, storages=storages
    )
    shapes = {**{k: tuple(v.shape) for k, v in sd.items()}, **{z.name: z.shape for z in plan.zeros}}
    uncast = fp32_modules.uncast(model, plan, shapes)
    return replace(plan, uncast=uncast, dtype_from=fp32_modules.dtype_from(model, plan, shapes, uncast))


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
