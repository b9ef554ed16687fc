"""OmegaConf configs in a trainer's JSON state: `DictConfig` and `ListConfig` saved as tagged JSON, loaded
back as the same type.

Hydra users give `save_hyperparameters()` a `DictConfig`, and Lightning's checkpoint then holds it and its
class (`hparams_type`). `state_tree` would take a `DictConfig` for a plain mapping (resolving its
interpolations, failing on a `???`) and refuses the rest, so `split` here takes each config out first: its
content as `OmegaConf.to_container(resolve=False)` gives it (interpolations stay strings such as
`"${a.b}"`), encoded by `state_tree` (so a value JSON cannot hold, a `Path` or `bytes`, is refused by name),
with its type and its `struct` and `readonly` flags; `OmegaConf.create` rebuilds it. A part of a config
(`cfg.model`) is saved with the whole config and the keys down to it, so its interpolations into the rest
resolve after loading as after a pickle's. A structured config
(one backed by a dataclass or attrs class) is refused: loading it would mean importing its class by name,
and a plain `DictConfig` in its place would drop its type checks.

The tagged nodes go into the skeleton `state_tree.split` made, where a raw dict holding the tag is only
ever one written by an encoder (a user's dict with that key is escaped): `restore` rebuilds them before
`state_tree.join`, which passes them through. omegaconf is imported only where a config is present or a
tag is read: it is no dependency of stagerd, and a process that has not imported it holds no config.
"""

from __future__ import annotations

import secrets
import sys
from collections.abc import Mapping
from typing import Any

import torch

from stagerd.errors import LoadError, SaveInputError
from stagerd.integrations import state_tree
from stagerd.integrations.state_tree import TAG

CONFIG = "omegaconf"
CONFIG_TYPE = "omegaconf_type"
_TYPES = ("DictConfig", "ListConfig")
_FLAGS = ("struct", "readonly")


def split(tree: Any, prefix: str) -> tuple[dict[str, torch.Tensor], Any]:
    """`state_tree.split(tree, prefix)`, with each OmegaConf config (and config class) in `tree` saved as a
    tagged node."""
    oc = sys.modules.get("omegaconf")
    if oc is None:  # never imported: nothing in `tree` is a config
        return state_tree.split(tree, prefix)
    nodes: dict[str, Any] = {}
    token = f"\0stagerd.omegaconf:{secrets.token_hex(16)}:"  # no value of the user's is this string

    def take(v: Any, path: str) -> Any:
        node = _encode(oc, v, path)
        if node is not None:
            nodes[key := f"{token}{len(nodes)}"] = node
            return key
        if isinstance(v, Mapping):
            return {k: take(x, f"{path}/{_escape(str(k))}") for k, x in v.items()}
        if isinstance(v, list | tuple):
            out = [take(x, f"{path}/{i}") for i, x in enumerate(v)]
            return out if isinstance(v, list) else tuple(out)
        return v

    try:
        taken = take(tree, prefix)
    except RecursionError:
        taken = tree  # state_tree.split names it
    tensors, skeleton = state_tree.split(taken, prefix)
    if not nodes:
        return tensors, skeleton

    def put(v: Any) -> Any:
        if isinstance(v, str) and v.startswith(token):
            return nodes[v]
        if isinstance(v, list):
            return [put(x) for x in v]
        if isinstance(v, dict):
            return {k: put(x) for k, x in v.items()}
        return v

    return tensors, put(skeleton)


def _encode(oc: Any, v: Any, path: str) -> dict[str, Any] | None:
    """The tagged node of a config or config class, None for any other value."""
    if isinstance(v, type) and v in (oc.DictConfig, oc.ListConfig):
        return {TAG: CONFIG_TYPE, "name": v.__name__}
    if not isinstance(v, oc.Container):
        return None
    if not isinstance(v, oc.DictConfig | oc.ListConfig):
        raise SaveInputError(f"{path}: an OmegaConf {type(v).__qualname__} cannot be saved")
    hint = (
        "give save_hyperparameters() a plain config, OmegaConf.create(OmegaConf.to_container(cfg)), or "
        "leave it out with ignore=[...]; stagerd never pickles"
    )
    # a part of a config (`cfg.model`) keeps its interpolations into the rest, as a pickle of it does: its
    # whole config is saved, and the keys down to it
    root, keys = v, []
    while (parent := root._get_parent()) is not None:
        keys.append(root._key())
        root = parent
    where = path if not keys else f"{path}/(the config it is part of)"
    try:
        content = oc.OmegaConf.to_container(root, resolve=False, structured_config_mode=oc.SCMode.DICT_CONFIG)
    except oc.errors.OmegaConfBaseException as e:
        first = str(e).splitlines()[0] if str(e) else ""
        raise SaveInputError(
            f"{where}: an OmegaConf config that cannot be read: {first}", hint=hint
        ) from None
    if isinstance(content, oc.Container) or _holds(oc, content):
        # a class's nodes stay configs in the content
        raise SaveInputError(
            f"{where}: a structured OmegaConf config (of a class) cannot be saved", hint=hint
        )
    tensors, skeleton = state_tree.split(content, where)
    _, down = state_tree.split(keys[::-1], f"{path}/(its keys)")
    if tensors:
        raise SaveInputError(f"{next(iter(tensors))}: a tensor in an OmegaConf config cannot be saved")
    on = {"struct": oc.OmegaConf.is_struct(root), "readonly": oc.OmegaConf.is_readonly(root)}
    flags = [f for f in _FLAGS if on[f]]
    return {
        TAG: CONFIG,
        "type": type(v).__name__,
        "root": type(root).__name__,
        "flags": flags,
        "content": skeleton,
        "keys": down,
    }


def _holds(oc: Any, v: Any) -> bool:
    if isinstance(v, oc.Container):
        return True
    if isinstance(v, dict):
        return any(_holds(oc, x) for x in v.values())
    return isinstance(v, list) and any(_holds(oc, x) for x in v)


def restore(skeleton: Any, path: Any) -> Any:
    """`skeleton` with each tagged config (and config class) `split` wrote rebuilt, for `state_tree.join`.
    LoadError on a malformed node (it came from disk) or, with one present, no omegaconf installed."""

    def dec(v: Any) -> Any:
        if isinstance(v, list):
            return [dec(x) for x in v]
        if not isinstance(v, dict):
            return v
        kind = v.get(TAG)
        if kind == CONFIG:
            return _config(v, path)
        if kind == CONFIG_TYPE:
            name = _name(v.get("name"), path)
            return getattr(_omegaconf(name, path), name)
        return {k: dec(x) for k, x in v.items()}

    try:
        return dec(skeleton)
    except RecursionError:
        return skeleton  # state_tree.join names it


def _config(node: dict[str, Any], path: Any) -> Any:
    name, root_name = _name(node.get("type"), path), _name(node.get("root"), path)
    flags = node.get("flags")
    if not isinstance(flags, list) or not all(f in _FLAGS for f in flags):
        raise LoadError("a malformed OmegaConf config in the saved trainer state", path=path)
    saved = {"content": node.get("content"), "keys": node.get("keys")}
    parts = state_tree.join(saved, lambda key: _no_tensor(key, path))
    content, keys = parts["content"], parts["keys"]
    if not isinstance(content, dict if root_name == "DictConfig" else list) or not isinstance(keys, list):
        raise LoadError(f"a malformed OmegaConf {root_name} in the saved trainer state", path=path)
    oc = _omegaconf(name, path)
    try:
        config = oc.OmegaConf.create(content, flags=dict.fromkeys(flags, True))
        for key in keys:
            config = config._get_node(key)  # the node itself: an interpolation to it is not followed
    except (oc.errors.OmegaConfBaseException, AttributeError, KeyError, IndexError, TypeError) as e:
        raise LoadError(
            f"a saved OmegaConf {name} cannot be rebuilt: {type(e).__name__}", path=path
        ) from None
    if type(config).__name__ != name:
        raise LoadError(f"a saved OmegaConf {name} rebuilt as a {type(config).__name__}", path=path)
    return config


def _name(name: Any, path: Any) -> str:
    if name not in _TYPES:
        raise LoadError(f"saved trainer state names an unknown OmegaConf type {name!r}", path=path)
    return str(name)


def _omegaconf(name: str, path: Any) -> Any:
    try:
        import omegaconf
    except ImportError:
        raise LoadError(
            f"the saved trainer state holds an OmegaConf {name}, and omegaconf is not installed",
            path=path,
            hint="pip install omegaconf (the version the run that saved it had); nothing was loaded",
        ) from None
    return omegaconf


def _no_tensor(key: str, path: Any) -> torch.Tensor:
    raise LoadError(f"a saved OmegaConf config names a tensor ({key})", path=path)


def _escape(part: str) -> str:
    return part.replace("~", "~0").replace("/", "~1")
