"""The to-Hub plan: how the trainer's tensors become the checkpoint's, declared in the commit marker.

The training side resolves it once at save time (from transformers' own conversion registry, a key
mapping, or the tied weights it saw) and the export engine carries it out as byte moves; the engine never
needs the model or transformers (the daemon resolves an adopted checkpoint's from its config.json, as
the training side does, where transformers is installed). Every output tensor is a box of one staged tensor:

- `views`: output `name` is `source[start : start + size]` (per dim), laid out as `shape` (the box's sizes
  with unit dims added or removed, nothing else: the box is read in row-major order);
- with `reshape` and `perm`, the box read in row-major order is viewed as `reshape`, its dims permuted
  by `perm`, and written in that order (the RoPE row permutation of a key mapping); still a permutation
  of elements, carried out as byte moves of whole runs (the dims after the last permuted one);
- several views of one `name`, each with `at` (its offset in the output) and `whole` (the output's shape),
  are the parts of one output: a concatenation or a stack of boxes of several staged tensors, which must
  tile it exactly;
- a staged tensor that no view reads and `drop` does not name is written as it is, under its own name;
- `drop`: staged tensors not written (a tied duplicate save_pretrained leaves out);
- `merges`: LoRA merges and casts (`LoraMerge`, `contract/lora_merge.py`), the one thing that is
  arithmetic, not a byte move: the engine computes `name` = base + scaling * (B @ A) (transposed with
  `fan_in_fan_out`; for DoRA times its magnitude over the norm per output; a LoRA bias: base + scaling *
  B's bias; a cast: base in another dtype) with numpy, in row blocks, into a scratch shard before
  planning, so `name` is then a staged tensor the views may read; the inputs it consumes are not written
  unless a view reads them;
- `zeros`: tensors of zeros (`ZeroFill`: name, dtype, shape) the views may read like staged tensors: the
  padding a conversion appends (`new_zeros` then `cat`) is a part whose source is one. The engine gives
  them a place in the same scratch shard, a sparse hole that reads as zeros, so they are copied like any
  other bytes and never held; a zero fill is never written under its own name;
- `uncast`: per cast target (`BF16`, `F16`), the outputs a cast to it leaves in their saved dtype: what
  transformers keeps in float32 when it holds the model in that dtype (`_keep_in_fp32_modules_strict` for
  both, `_keep_in_fp32_modules` for F16 too), so the export is what `save_pretrained` of the model loaded
  in that dtype writes. An older stagerd ignores it and casts them;
- `dtype_from`: where the model's first floating parameter is among those outputs, its output:
  `save_pretrained` names the model's dtype in config.json by that parameter (`PreTrainedModel.dtype`),
  so a cast export whose plan leaves it uncast names its saved dtype, not the cast's.

Splits (MoE experts, fused QKV or gate/up), renames, tied duplicates written with their own bytes, and
dropped keys are all views. No torch here: the daemon reads this.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from stagerd.contract import dtypes
from stagerd.contract.json_fields import as_int, as_ints, as_str, as_strs
from stagerd.contract.lora_merge import MARKER_LISTS, LoraMerge
from stagerd.errors import DTypeError, HubPlanError

HUB_PLAN_FORMAT = "stagerd.hub/1"


class Holds(StrEnum):
    """When a shared storage holds: always (a split's views of one tensor: a cast keeps them one storage);
    only while the dtype is kept (the trainer's memory layout: a flat buffer, which a cast, as
    `model.to(dtype)`, gives each parameter a storage of its own); only under a cast (what a group of the
    kept layout becomes then)."""

    ALWAYS = "always"
    KEPT = "kept"
    CAST = "cast"


@dataclass(frozen=True, slots=True)
class SharedStorage:
    """Outputs that are views of one storage of `numel` elements in the saving library's state dict,
    where `holds` says (a marker without it: always)."""

    names: tuple[str, ...]
    numel: int
    holds: Holds = Holds.ALWAYS


@dataclass(frozen=True, slots=True)
class TensorView:
    """Output tensor `name`: the box `start`/`size` of staged tensor `source`, as `shape`."""

    name: str
    source: str
    start: tuple[int, ...]
    size: tuple[int, ...]
    shape: tuple[int, ...]
    reshape: tuple[int, ...] = ()
    perm: tuple[int, ...] = ()
    at: tuple[int, ...] = ()  # a part of output `name`, placed at this offset; `whole` is the output's shape
    whole: tuple[int, ...] = ()

    def is_whole(self, source_shape: tuple[int, ...]) -> bool:
        whole = tuple(self.size) == tuple(source_shape) and tuple(self.shape) == tuple(source_shape)
        return whole and not self.perm and not self.at


@dataclass(frozen=True, slots=True)
class ZeroFill:
    """A tensor of zeros named `name`, of safetensors `dtype` and `shape`, that views read as a source."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    def check(self, *, path: object = None) -> None:
        try:
            dt = dtypes.lookup(self.dtype)
        except DTypeError:
            raise HubPlanError(f"zero fill {self.name!r}: unknown dtype {self.dtype!r}", path=path) from None
        if any(n < 0 for n in self.shape) or (dt.bits * math.prod(self.shape)) % 8:
            raise HubPlanError(
                f"zero fill {self.name!r}: shape {list(self.shape)} is not whole bytes", path=path
            )


@dataclass(frozen=True)
class HubPlan:
    """See the module docstring. `origin` says who resolved it: transformers, mapping, or aliases."""

    views: tuple[TensorView, ...] = ()
    drop: tuple[str, ...] = ()
    origin: str = "aliases"
    format: str = HUB_PLAN_FORMAT
    merges: tuple[LoraMerge, ...] = ()
    zeros: tuple[ZeroFill, ...] = ()
    # How the library's own save (save_pretrained) splits the outputs into files, so that a sharded export
    # is its files too: every output name in the order its state dict walks them (empty: natural key
    # order); the outputs that share one storage there (a split's views), which its splitter sizes by
    # that storage (in the index's `total_size` too) and keeps in one file, each with when it holds (a
    # flat buffer's grouping only while the dtype is kept); and the index's `total_parameters` (its
    # num_parameters()).
    order: tuple[str, ...] = ()
    shared: tuple[SharedStorage, ...] = ()
    parameters: int | None = None
    uncast: tuple[tuple[str, tuple[str, ...]], ...] = ()  # (cast target, outputs it leaves as saved)
    dtype_from: str | None = None

    def uncast_for(self, target: str | None) -> tuple[str, ...]:
        """The outputs a cast to `target` (a safetensors name; None: kept) leaves in their saved dtype."""
        return next((names for dt, names in self.uncast if dt == target), ())

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "format": self.format,
            "origin": self.origin,
            "views": [_view_json(v) for v in self.views],
            "drop": list(self.drop),
        }  # fmt: skip
        for key, kinds in MARKER_LISTS.items():  # apart: an older stagerd must not take them for plain LoRA
            listed = [m.to_json() for m in self.merges if m.kind in kinds]
            d |= {key: listed} if listed else {}
        if self.zeros:
            d["zeros"] = [{"name": z.name, "dtype": z.dtype, "shape": list(z.shape)} for z in self.zeros]
        if self.order:
            d["order"] = list(self.order)
        if self.shared:
            d["shared"] = [
                {"names": list(g.names), "numel": g.numel}
                | ({"holds": g.holds.value} if g.holds is not Holds.ALWAYS else {})
                for g in self.shared
            ]
        if self.parameters is not None:
            d["parameters"] = self.parameters
        if self.uncast:
            d["uncast"] = {dt: list(names) for dt, names in self.uncast}
        if self.dtype_from is not None:
            d["dtype_from"] = self.dtype_from
        return d

    @classmethod
    def from_json(cls, d: Any, *, path: object = None) -> HubPlan:
        """Parse a marker's plan; any defect is a HubPlanError."""
        try:
            if not isinstance(d, dict) or d.get("format") != HUB_PLAN_FORMAT:
                raise HubPlanError(f"not a {HUB_PLAN_FORMAT} plan", path=path)
            views = tuple(
                TensorView(
                    as_str(v["name"]),
                    as_str(v["source"]),
                    as_ints(v["start"]),
                    as_ints(v["size"]),
                    as_ints(v["shape"]),
                    as_ints(v.get("reshape", [])),
                    as_ints(v.get("perm", [])),
                    as_ints(v.get("at", [])),
                    as_ints(v.get("whole", [])),
                )
                for v in d["views"]
            )
            merges: tuple[LoraMerge, ...] = ()
            for key, kinds in MARKER_LISTS.items():
                listed = tuple(LoraMerge.from_json(m) for m in d.get(key, ()))
                if any(m.kind not in kinds for m in listed):
                    raise ValueError("a merge listed among those of another kind")
                merges += listed
            zeros = tuple(
                ZeroFill(as_str(z["name"]), as_str(z["dtype"]), as_ints(z["shape"]))
                for z in d.get("zeros", ())
            )
            drop = tuple(as_str(n) for n in d.get("drop", ()))
            order = as_strs(d.get("order", []))
            shared = tuple(
                SharedStorage(as_strs(g["names"]), as_int(g["numel"]), _holds(g.get("holds", Holds.ALWAYS)))
                for g in d.get("shared", ())
            )
            parameters = None if d.get("parameters") is None else as_int(d["parameters"])
            origin = as_str(d.get("origin", "aliases"))
            uncast = uncast_targets(d.get("uncast", {}), as_strs)
            dtype_from = None if d.get("dtype_from") is None else as_str(d["dtype_from"])
            return cls(
                views,
                drop,
                origin,
                merges=merges,
                zeros=zeros,
                order=order,
                shared=shared,
                parameters=parameters,
                uncast=uncast,
                dtype_from=dtype_from,
            )
        except (KeyError, TypeError, ValueError) as e:
            raise HubPlanError(f"malformed to-Hub plan: {e!r}", path=path) from None

    def outputs(self, shapes: Mapping[str, tuple[int, ...]], *, path: object = None) -> list[TensorView]:
        """Every output tensor, checked against the staged tensors' global `shapes`: views first, then the
        staged tensors neither read by a view nor dropped. Raises HubPlanError where the plan and the
        checkpoint disagree or two outputs share a name. A merge's output must be among `shapes` (the
        engine computed it), and its inputs are read; so must a zero fill, which is only ever read."""
        read: set[str] = set()
        out: list[TensorView] = []
        for z in self.zeros:
            z.check(path=path)
            if tuple(shapes.get(z.name, ())) != z.shape or z.name not in shapes:
                raise HubPlanError(f"the zero fill {z.name!r} was not made", path=path)
            read.add(z.name)
        for m in self.merges:
            m.check(shapes, path=path)
            if m.name not in shapes:
                raise HubPlanError(f"the merge {m.name!r} was not computed", path=path)
            read.update(m.inputs)
        for v in self.views:
            src = shapes.get(v.source)
            if src is None:
                raise HubPlanError(f"view {v.name!r} reads {v.source!r}, which was not saved", path=path)
            check_box(v, src, path=path)
            read.add(v.source)
            out.append(v)
        for n in self.drop:
            if n not in shapes:
                raise HubPlanError(f"the plan drops {n!r}, which was not saved", path=path)
        dropped = set(self.drop)
        for name, shape in shapes.items():
            if name not in read and name not in dropped:
                out.append(TensorView(name, name, (0,) * len(shape), tuple(shape), tuple(shape)))
        seen: dict[str, TensorView] = {}
        parts: dict[str, list[TensorView]] = {}
        for v in out:
            first = seen.setdefault(v.name, v)
            if v.at and first.at and v.whole == first.whole:
                parts.setdefault(v.name, []).append(v)
            elif first is not v or v.at:
                why = "its parts disagree" if v.at else f"from {first.source!r} and {v.source!r}"
                raise HubPlanError(f"two tensors are named {v.name!r} ({why})", path=path)
        for name, ps in parts.items():
            _check_parts(name, ps, path)
        return out


def _check_parts(name: str, parts: list[TensorView], path: object) -> None:
    """The parts of one output lie inside it, do not overlap, and cover it."""
    whole = parts[0].whole
    boxes = []
    for p in parts:
        if len(p.at) != len(whole) or len(p.shape) != len(whole):
            raise HubPlanError(
                f"{name!r}: a part's place {list(p.at)} has not the dims of {list(whole)}", path=path
            )
        if any(a < 0 or a + n > w for a, n, w in zip(p.at, p.shape, whole, strict=True)):
            raise HubPlanError(f"{name!r}: a part at {list(p.at)} runs outside {list(whole)}", path=path)
        boxes.append((p.at, p.shape))
    for i, (a, s) in enumerate(boxes):
        for b, t in boxes[:i]:
            if all(x < y + m and y < x + n for x, n, y, m in zip(a, s, b, t, strict=True)):
                raise HubPlanError(f"{name!r}: two parts overlap at {list(a)} and {list(b)}", path=path)
    if sum(math.prod(s) for _, s in boxes) != math.prod(whole):
        raise HubPlanError(f"{name!r}: its parts do not cover {list(whole)}", path=path)


# A permutation that moves single elements (RoPE's row order applied to a bias) is carried out one element
# per piece: allowed for tensors up to this many elements.
MAX_ELEMENT_MOVES = 1 << 16


def moves_by_lines(v: TensorView) -> bool:
    """A permuted view whose last dim moves and which permutes its box's own dims (a transpose): carried
    out line by line, each line of the source's last dim a line of the output."""
    nd = len(v.size)
    box_dims = [d for d in range(nd) if v.size[d] != 1]
    permuted = [v.reshape[p] for p in v.perm]
    out_dims = [j for j, n in enumerate(v.shape) if n != 1]
    return (
        tuple(v.reshape) == tuple(v.size[d] for d in box_dims)
        and bool(box_dims)
        and box_dims[-1] == nd - 1
        and [n for n in permuted if n != 1] == [v.shape[j] for j in out_dims]
        and len(out_dims) == len(permuted)
    )


def moves_elements(v: TensorView) -> bool:
    """A permuted view whose last dim moves and that is not a transpose of its box: element by element."""
    return bool(v.perm) and v.perm[-1] != len(v.perm) - 1 and not moves_by_lines(v)


def _view_json(v: TensorView) -> dict[str, Any]:
    d: dict[str, Any] = {"name": v.name, "source": v.source, "start": list(v.start), "size": list(v.size)}
    d["shape"] = list(v.shape)
    if v.perm:
        d["reshape"], d["perm"] = list(v.reshape), list(v.perm)
    if v.at:
        d["at"], d["whole"] = list(v.at), list(v.whole)
    return d


def check_box(v: TensorView, src: tuple[int, ...], *, path: object = None) -> None:
    """`v`'s box lies inside its source of shape `src`, and `v.shape` is that box up to unit dims."""
    if len(v.start) != len(src) or len(v.size) != len(src):
        raise HubPlanError(f"view {v.name!r}: its box has not the {len(src)} dims of {v.source!r}", path=path)
    # Products alone cannot see a sign: a marker's shape [-3, -7] passed for a box of 21 elements and
    # was written as [1, 1], a reshape [-3, -7] permuted garbage into place.
    for field in ("shape", "reshape", "at", "whole"):
        if any(n < 0 for n in getattr(v, field)):
            raise HubPlanError(
                f"view {v.name!r}: its {field} {list(getattr(v, field))} is negative", path=path
            )
    for d, (a, n, g) in enumerate(zip(v.start, v.size, src, strict=True)):
        if a < 0 or n < 0 or a + n > g:
            raise HubPlanError(
                f"view {v.name!r}: [{a}:{a + n}] of dim {d} is outside {v.source!r}{list(src)}", path=path
            )
    if v.perm or v.reshape:
        if sorted(v.perm) != list(range(len(v.reshape))) or math.prod(v.reshape) != math.prod(v.size):
            raise HubPlanError(
                f"view {v.name!r}: perm {list(v.perm)} of reshape {list(v.reshape)} does not permute its box "
                f"{list(v.size)}",
                path=path,
            )
        if math.prod(v.shape) != math.prod(v.size):
            raise HubPlanError(
                f"view {v.name!r}: shape {list(v.shape)} is not its box {list(v.size)}", path=path
            )
        if moves_elements(v) and math.prod(v.size) > MAX_ELEMENT_MOVES:
            raise HubPlanError(
                f"view {v.name!r}: perm {list(v.perm)} of {list(v.reshape)} moves single elements of "
                f"{v.source!r}, more than {MAX_ELEMENT_MOVES}; only a permutation of its box's dims, or of "
                "whole runs, is planned for a tensor this size",
                path=path,
            )
        return
    if [n for n in v.size if n != 1] != [n for n in v.shape if n != 1] or math.prod(v.size) != math.prod(
        v.shape
    ):
        raise HubPlanError(
            f"view {v.name!r}: shape {list(v.shape)} is not its box {list(v.size)} of {v.source!r}",
            path=path,
        )


def uncast_targets(d: Any, names: Any) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """A marker's `uncast` (`{target: names}`, each list read by `names`); a target that is no cast target
    is a ValueError (a malformed plan), never a list applied to another dtype."""
    if not isinstance(d, dict):
        raise TypeError(f"expected an object of cast targets, got {type(d).__name__}")
    out = []
    for dt, listed in d.items():
        try:
            castable = dtypes.lookup(as_str(dt)).castable
        except DTypeError:
            castable = False
        if not castable:
            raise ValueError(f"uncast names {str(dt)[:50]!r}, which is no cast target")
        out.append((dt, tuple(names(listed))))
    return tuple(out)


def _holds(x: Any) -> Holds:
    """A shared storage's `holds`; an unknown one is a ValueError (a malformed plan)."""
    return Holds(as_str(x))
