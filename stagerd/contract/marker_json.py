"""The commit marker's compact JSON: its tensor table, and its to-Hub plans written against that table.

A marker lists every tensor, so its size and the memory of reading it grow with the tensor count; this form
keeps both to a few dozen bytes per tensor beyond the names themselves, which are written once:

- `tensors`: `{"names": [...], "infos": [[dtype, shape], ...], "info": [i, ...]}`: tensor `names[k]` has
  the dtype and shape `infos[info[k]]` (the distinct pairs, few in a model: its layers repeat);
- a plan (`stagerd.hub/2`): its views as columns, `views: {"names", "sources", "box", "boxes"}`: view k
  is output `names[k]` (null: the name of its source) reading `sources[k]` (an index into the tensor
  names, or a name) through box `boxes[box[k]]` = `[start, size, shape, reshape, perm, at, whole]`, empty
  fields at the end left out; `drop`, `order` and each `shared` storage's names are name lists, whose items
  are names or runs `[first, count]` of the tensor names followed by the views' names, so a save order
  that walks the tensors and the views in runs is a few numbers. A shared storage is `[numel, names]`, or
  `[numel, names, holds]` where it does not always hold (`Holds`; one without it always holds); `uncast`
  is `{target: name list}`. Merges,
  zero fills, `origin` and `parameters` are as in `stagerd.hub/1` (`HubPlan.to_json`);
- `reference_index`, where it is a weight_map: `{"files": [...], "names": [name list per file]}`, over the
  tensor names followed by the hub plan's view names.

The reader takes the older form as well (a dict of `{"dtype", "shape"}` per tensor, a `stagerd.hub/1` plan,
a weight_map of a file name per tensor name), section by section. Equal dtype/shape pairs and boxes are one
object once read, so what a marker keeps in memory is its names, one dict entry per tensor and one
`TensorView` per view.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any, TypeVar

from stagerd.contract.hub_plan import (
    HUB_PLAN_FORMAT,
    Holds,
    HubPlan,
    SharedStorage,
    TensorView,
    uncast_targets,
)
from stagerd.errors import HubPlanError, MarkerError

COMPACT_PLAN_FORMAT = "stagerd.hub/2"
_BOX_FIELDS = 7  # start, size, shape, reshape, perm, at, whole
_Box = tuple[tuple[int, ...], ...]

Info = TypeVar("Info")


def encode_tensors(names: Iterable[str], infos: Iterable[tuple[str, tuple[int, ...]]]) -> dict[str, Any]:
    """The tensor table of `names`, each with its (dtype, shape) from `infos`."""
    table: dict[tuple[str, tuple[int, ...]], int] = {}
    names = list(names)
    info = [table.setdefault((d, tuple(s)), len(table)) for d, s in infos]
    return {"names": names, "infos": [[d, list(s)] for d, s in table], "info": info}


def is_compact_tensors(d: Any) -> bool:
    """Whether a marker's `tensors` is the table (an older marker's has an object per tensor name)."""
    return isinstance(d, dict) and isinstance(d.get("names"), list)


def decode_tensors(d: Any, make: Callable[[str, tuple[int, ...]], Info], *, path: object) -> dict[str, Info]:
    """Name -> `make(dtype, shape)` of a marker's `tensors`, in either form; one `make` per distinct pair."""
    made: dict[tuple[str, tuple[int, ...]], Info] = {}

    def info(dtype: Any, shape: Any, name: Any) -> Info:
        # int() would take 2.5, true and 1e300, and raise OverflowError on Infinity (valid JSON here)
        if not (isinstance(dtype, str) and isinstance(shape, list)) or not all(is_dim(x) for x in shape):
            raise MarkerError(
                f"tensor {str(name)[:200]!r}: its dtype and shape must be a string and non-negative integers",
                path=path,
            )
        key = (dtype, tuple(shape))
        got = made.get(key)
        if got is None:
            got = made[key] = make(*key)
        return got

    if not is_compact_tensors(d):
        return {k: info(v["dtype"], v["shape"], k) for k, v in d.items()}
    names, infos, index = d["names"], d["infos"], d["info"]
    if not (isinstance(infos, list) and isinstance(index, list) and len(index) == len(names)):
        raise MarkerError("the tensor table's names, infos and info do not match up", path=path)
    pairs = (pair if _pair(pair) else (None, None) for pair in infos)
    table = [info(dtype, shape, f"infos[{i}]") for i, (dtype, shape) in enumerate(pairs)]
    out: dict[str, Info] = {}
    for name, i in zip(names, index, strict=True):
        if not isinstance(name, str) or name in out:
            raise MarkerError(f"tensor {str(name)[:200]!r} is not a name, or is listed twice", path=path)
        if not (is_dim(i) and i < len(table)):
            raise MarkerError(f"tensor {name[:200]!r}: info {i!r} is not in the table", path=path)
        out[name] = table[i]
    return out


def encode_plan(plan: HubPlan, tensors: Sequence[str]) -> dict[str, Any]:
    """`plan` in the compact form, against the marker's tensor names `tensors` (in their order)."""
    d = replace(plan, views=(), drop=(), order=(), shared=(), uncast=()).to_json()
    d["format"] = COMPACT_PLAN_FORMAT
    index: dict[str, int] = {}
    for i, n in enumerate(tensors):
        index.setdefault(n, i)
    boxes: dict[_Box, int] = {}
    names: list[str | None] = []
    sources: list[int | str] = []
    box: list[int] = []
    for v in plan.views:
        names.append(None if v.name == v.source else v.name)
        sources.append(index.get(v.source, v.source))
        fields = (v.start, v.size, v.shape, v.reshape, v.perm, v.at, v.whole)
        box.append(boxes.setdefault(tuple(tuple(f) for f in fields), len(boxes)))
    for i, v in enumerate(plan.views):
        index.setdefault(v.name, len(tensors) + i)
    d["views"] = {"names": names, "sources": sources, "box": box, "boxes": [_box_json(b) for b in boxes]}
    d["drop"] = _encode_names(plan.drop, index)
    if plan.order:
        d["order"] = _encode_names(plan.order, index)
    if plan.shared:
        d["shared"] = [_shared_json(g, index) for g in plan.shared]
    if plan.uncast:
        d["uncast"] = {dt: _encode_names(names, index) for dt, names in plan.uncast}
    return d


def decode_plan(d: Any, tensors: Sequence[str], *, path: object) -> HubPlan:
    """A marker's plan in either form; the compact one against the marker's tensor names `tensors`."""
    if not (isinstance(d, dict) and d.get("format") == COMPACT_PLAN_FORMAT):
        return HubPlan.from_json(d, path=path)
    try:
        rest = {k: v for k, v in d.items() if k not in ("views", "drop", "order", "shared", "uncast")}
        base = HubPlan.from_json({**rest, "format": HUB_PLAN_FORMAT, "views": []}, path=path)
        v = d["views"]
        names, sources, box = v["names"], v["sources"], v["box"]
        if not all(isinstance(c, list) for c in (names, sources, box)) or not (
            len(names) == len(sources) == len(box)
        ):
            raise HubPlanError("the plan's view columns are not lists of one length", path=path)
        boxes = [_box(b) for b in v["boxes"]]
        views = _views(names, sources, box, tensors, boxes, path)
        table = _NameTable(tensors, [v.name for v in views])
        shared = _Budget(table)  # an output is in one shared storage at most
        return replace(
            base,
            views=views,
            drop=_decode_names(d.get("drop", []), table, path),
            order=_decode_names(d.get("order", []), table, path),
            shared=tuple(_shared(g, table, path, shared) for g in d.get("shared", ())),
            uncast=uncast_targets(d.get("uncast", {}), lambda items: _decode_names(items, table, path)),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise HubPlanError(f"malformed to-Hub plan: {e!r}", path=path) from None


def _shared_json(g: SharedStorage, index: Mapping[str, int]) -> list[Any]:
    out: list[Any] = [g.numel, _encode_names(g.names, index)]
    return out if g.holds is Holds.ALWAYS else [*out, g.holds.value]


def _shared(g: Any, table: _NameTable, path: object, budget: _Budget) -> SharedStorage:
    """`[numel, names]`, or `[numel, names, holds]` where it does not always hold (an older reader refuses
    that as a malformed plan rather than apply a grouping that does not hold)."""
    if not isinstance(g, list) or len(g) not in (2, 3) or not all(isinstance(h, str) for h in g[2:]):
        raise TypeError(f"expected [numel, names] or [numel, names, holds], got {str(g)[:200]}")
    holds = Holds(g[2]) if len(g) == 3 else Holds.ALWAYS  # an unknown one: ValueError
    return SharedStorage(_decode_names(g[1], table, path, budget), _count(g[0]), holds)


def encode_weight_map(wm: Mapping[str, str], tensors: Sequence[str], plan: HubPlan | None) -> dict[str, Any]:
    """A reference index's weight_map as `{"files": [...], "names": [name list per file]}`, its names as
    runs over the tensor names followed by the plan's view names."""
    index: dict[str, int] = {}
    for i, n in enumerate([*tensors, *(v.name for v in plan.views)] if plan is not None else tensors):
        index.setdefault(n, i)
    by_file: dict[str, list[str]] = {}
    for name, file in wm.items():
        by_file.setdefault(file, []).append(name)
    return {"files": list(by_file), "names": [_encode_names(ns, index) for ns in by_file.values()]}


def decode_weight_map(
    d: dict[str, Any], tensors: Sequence[str], plan: HubPlan | None, *, path: object
) -> Any:
    """A marker's weight_map in either form (an older marker's maps each name to its file)."""
    if not isinstance(d.get("files"), list):
        return d
    files, names = d["files"], d["names"]
    if not (isinstance(names, list) and len(names) == len(files) and all(isinstance(f, str) for f in files)):
        raise HubPlanError("the reference index's files and names do not match up", path=path)
    table = _NameTable(tensors, [v.name for v in plan.views] if plan is not None else [])
    budget = _Budget(table)  # each name is in one file
    return {n: f for f, ns in zip(files, names, strict=True) for n in _decode_names(ns, table, path, budget)}


def is_dim(x: Any) -> bool:
    """A non-negative integer (never a bool, which JSON's true is)."""
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _pair(x: Any) -> bool:
    return isinstance(x, list) and len(x) == 2


def _count(x: Any) -> int:
    if not is_dim(x):
        raise TypeError(f"expected a non-negative integer, got {x!r}")
    return int(x)


def _box_json(b: _Box) -> list[list[int]]:
    out = [list(f) for f in b]
    while len(out) > 3 and not out[-1]:
        out.pop()
    return out


def _box(b: Any) -> _Box:
    if not isinstance(b, list) or not 3 <= len(b) <= _BOX_FIELDS:
        raise TypeError(f"expected a box of 3 to {_BOX_FIELDS} lists of integers, got {str(b)[:200]}")
    fields = [*b, *([[]] * (_BOX_FIELDS - len(b)))]
    for f in fields:
        if not isinstance(f, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in f):
            raise TypeError(f"expected a list of integers, got {str(f)[:200]}")
    return tuple(tuple(f) for f in fields)


def _views(
    names: list[Any],
    sources: list[Any],
    box: list[Any],
    tensors: Sequence[str],
    boxes: list[_Box],
    path: object,
) -> tuple[TensorView, ...]:
    out = []
    n, nb = len(tensors), len(boxes)
    for name, source, b in zip(names, sources, box, strict=True):
        if type(source) is int and 0 <= source < n:  # type(), not isinstance(): JSON's true is no index
            source = tensors[source]
        elif not isinstance(source, str):
            raise HubPlanError(f"a view reads {str(source)[:200]!r}, not a saved tensor's name", path=path)
        if name is None:
            name = source
        elif not isinstance(name, str):
            raise HubPlanError(f"a view of {source[:200]!r} is named {str(name)[:200]}", path=path)
        if not (type(b) is int and 0 <= b < nb):
            raise HubPlanError(f"view {name[:200]!r}: box {b!r} is not in the plan's boxes", path=path)
        out.append(TensorView(name, source, *boxes[b]))
    return tuple(out)


class _NameTable:
    """The names a plan's name lists index: the marker's tensor names, then its views' names."""

    def __init__(self, tensors: Sequence[str], views: list[str]) -> None:
        self.tensors, self.views = tensors, views

    def __len__(self) -> int:
        return len(self.tensors) + len(self.views)

    def run(self, first: int, count: int) -> Sequence[str]:
        n, end = len(self.tensors), first + count
        if end <= n:
            return self.tensors[first:end]
        if first >= n:
            return self.views[first - n : end - n]
        return [*self.tensors[first:], *self.views[: end - n]]


def _encode_names(names: Iterable[str], index: Mapping[str, int]) -> list[str | list[int]]:
    out: list[str | list[int]] = []
    for name in names:
        i = index.get(name)
        if i is None:
            out.append(name)
        elif out and isinstance(last := out[-1], list) and last[0] + last[1] == i:
            last[1] += 1
        else:
            out.append([i, 1])
    return out


class _Budget:
    """How many names the runs of one name list, or of lists that share the table's names between them,
    may still expand to: the table's length, as each of its names is listed once. A run is a few bytes of
    JSON and expands to as many names as it counts, so without this a marker of a few kilobytes would
    read as billions of names."""

    def __init__(self, table: _NameTable) -> None:
        self.left = len(table)


def _decode_names(
    items: Any, table: _NameTable, path: object, budget: _Budget | None = None
) -> tuple[str, ...]:
    if not isinstance(items, list):
        raise TypeError(f"expected a list of names, got {type(items).__name__}")
    budget = budget or _Budget(table)
    out: list[str] = []
    for item in items:
        if isinstance(item, str):
            out.append(item)
            continue
        if not (_pair(item) and all(is_dim(x) for x in item) and item[0] + item[1] <= len(table)):
            raise HubPlanError(f"the plan names {str(item)[:200]}: not a name, nor a run of names", path=path)
        budget.left -= item[1]
        if budget.left < 0:
            raise HubPlanError(
                f"the name runs list more names than the {len(table)} the marker has (each once)", path=path
            )
        out.extend(table.run(*item))
    return tuple(out)
