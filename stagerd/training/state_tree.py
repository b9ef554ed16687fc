"""A nested state dict as flat leaves: tensors and everything else, each under its dotted name, and back.

A leaf's name joins its path with dots, as DCP names it (`state.model.norm.weight.exp_avg`,
`param_groups.0.lr`): dicts and lists are walked (dict keys by `str`, list items by index), tuples too
when they hold tensors (else a tuple is one leaf). A flat dict whose keys already hold the dots names its
leaves the same way, so a step saved nested loads flat and the other way round. The non-tensor leaves
are what an optimizer's state dict holds besides its tensors (numbers, strings, None, tuples): what
`torch.load(weights_only=True)` reads back.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

from stagerd.errors import SaveInputError


def _has_tensor(obj: Any) -> bool:
    if isinstance(obj, torch.Tensor):
        return True
    if isinstance(obj, Mapping):
        return any(_has_tensor(v) for v in obj.values())
    if isinstance(obj, list | tuple):
        return any(_has_tensor(v) for v in obj)
    return False


def _container(obj: Any) -> bool:
    return isinstance(obj, Mapping | list) or (isinstance(obj, tuple) and _has_tensor(obj))


def walk(
    obj: Any, path: str = "", parent: Any = None, key: Any = None
) -> Iterator[tuple[str, Any, Any, Any]]:
    """(dotted name, leaf, its container, its key in the container) of every leaf under `obj`."""
    if isinstance(obj, torch.Tensor) or not _container(obj):
        yield path, obj, parent, key
        return
    items = obj.items() if isinstance(obj, Mapping) else enumerate(obj)
    for k, v in items:
        yield from walk(v, f"{path}.{k}" if path else str(k), obj, k)


def split_leaves(tree: Mapping[str, Any], what: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """({name: tensor}, {name: other leaf}); two paths with one name are a SaveInputError."""
    tensors: dict[str, torch.Tensor] = {}
    objects: dict[str, Any] = {}
    for name, leaf, _, _ in walk(tree):
        if name in tensors or name in objects:
            raise SaveInputError(f"{what}: two entries are both named {name!r} once flattened")
        if isinstance(leaf, torch.Tensor):
            tensors[name] = leaf
        else:
            objects[name] = leaf
    return tensors, objects


def set_objects(target: Mapping[str, Any], saved: Mapping[str, Any]) -> list[str]:
    """Set every non-tensor leaf of `target` in place to its saved value; the names `saved` lacks."""
    missing = []
    for name, leaf, parent, key in walk(target):
        if isinstance(leaf, torch.Tensor):
            continue
        if name not in saved:
            missing.append(name)
        elif isinstance(parent, dict | list):
            parent[key] = saved[name]
    return missing


def _containers(obj: Any, path: str, out: set[str]) -> None:
    if isinstance(obj, torch.Tensor) or not _container(obj):
        return
    if path:
        out.add(path)
    items = obj.items() if isinstance(obj, Mapping) else enumerate(obj)
    for k, v in items:
        _containers(v, f"{path}.{k}" if path else str(k), out)


def unplaced(target: Mapping[str, Any], names: Iterable[str]) -> list[str]:
    """The saved `names` that `target` has no leaf for, though it has a container above them (the empty
    `state` of an optimizer that never stepped): a load into `target` would drop them."""
    leaves = {name for name, _, _, _ in walk(target)}
    held: set[str] = set()
    _containers(target, "", held)
    out = []
    for name in names:
        parts = name.split(".")
        if name not in leaves and any(".".join(parts[:i]) in held for i in range(1, len(parts))):
            out.append(name)
    return out
