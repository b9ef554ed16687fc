"""Which transformers model a save holds, when `Stager.save` is not handed the model itself.

- `inner_model`: the one transformers model inside a module that is not one (a LightningModule, a
  wrapper of the user's), and the prefix its keys carry in the module's state dict.
- `from_config`: the model that `extras["config.json"]` describes, built once on the meta device (no
  memory, no initialisation), from its `architectures` or, without them (a model built with
  `from_config` has none until `save_pretrained`), from every class transformers maps its `model_type`
  to; the one whose state dict keys are the saved keys (under one prefix) is the model. Where none fits,
  the reason comes back as a string, for the caller to warn with; a config that is not a transformers
  model's (`"model_type": "tiny"`) gets None, and no warning. Only where the process has imported
  transformers (holding a transformers model, it has): a save never imports it.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

CONFIG_NAME = "config.json"
MAX_CONFIG_BYTES = 16 << 20


@dataclass(frozen=True)
class Found:
    """A transformers model whose keys are the saved keys that start with `prefix` (stripped)."""

    model: Any
    prefix: str


def inside_compile(model: Any) -> Any:
    """The module inside `torch.compile`'s wrapper (an `OptimizedModule`) `model`, else None."""
    inner = getattr(model, "_orig_mod", None) if isinstance(model, torch.nn.Module) else None
    return inner if isinstance(inner, torch.nn.Module) else None


def uncompiled(model: Any) -> Any:
    """`model` outside every `torch.compile` wrapper: its `state_dict` keys carry no `_orig_mod.`, as
    `get_model_state_dict`'s do not."""
    while (inner := inside_compile(model)) is not None:
        model = inner
    return model


def inner_model(module: Any) -> Found | None:
    """The outermost transformers model in `module`, if there is exactly one (and no PEFT model)."""
    tf = sys.modules.get("transformers")
    named = getattr(module, "named_modules", None)
    if tf is None or named is None:
        return None
    peft = sys.modules.get("peft")
    found: list[tuple[str, Any]] = []
    for name, m in named():
        if peft is not None and isinstance(m, peft.PeftModel):
            return None  # its names are PEFT's: the PeftModel itself must be given as model=
        inside = any(p == "" or name.startswith(f"{p}.") for p, _ in found)
        if isinstance(m, tf.PreTrainedModel) and not inside:
            found.append((name, m))
    if len(found) != 1:
        return None
    name, model = found[0]
    return Found(model, f"{name}." if name else "")


def config_dict(config: Any) -> dict[str, Any] | None:
    """`extras["config.json"]` as a dict: given as a dict, JSON bytes or text, a file path, or a config
    object (`model.config`: its `to_dict()`); None if unreadable."""
    try:
        if isinstance(config, Mapping):
            return dict(config)
        if isinstance(config, bytes | bytearray | memoryview):
            data: Any = json.loads(bytes(config))
        elif isinstance(config, str) and config.lstrip().startswith("{"):  # JSON text, as save() takes it
            data = json.loads(config)
        elif callable(getattr(config, "to_dict", None)):
            data = config.to_dict()
        elif isinstance(config, str | os.PathLike):
            path = Path(config)
            if not path.is_file() or path.stat().st_size > MAX_CONFIG_BYTES:
                return None
            data = json.loads(path.read_bytes())
        else:
            return None
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def from_config(config: Mapping[str, Any], keys: Collection[str]) -> Found | str | None:
    """The model `config` describes whose state dict keys are `keys` (see the module docstring); why not,
    as a string, for a config of a transformers architecture; None for a config that is not one.

    transformers is not imported here: a process holding a transformers model has imported it already,
    and a save must not pay seconds of imports for a config of some other model (`"model_type": "tiny"`).
    """
    model_type = config.get("model_type")
    architectures = [a for a in config.get("architectures") or () if isinstance(a, str)]
    tf = sys.modules.get("transformers")
    if tf is None:
        if architectures:
            return (f"config.json names {architectures[0]}, but transformers is not loaded in this process; "
                    "for a trainer with names of its own, pass mapping=")  # fmt: skip
        return None
    try:  # a lazy mapping: its `get` does not look the name up
        config_class = tf.CONFIG_MAPPING[model_type] if isinstance(model_type, str) else None
    except KeyError:
        config_class = None
    if config_class is None or not isinstance(model_type, str):
        if architectures:
            return f"config.json names {architectures[0]}, but its model_type {model_type!r} is unknown"
        return None  # not a transformers model's config
    try:
        cfg = config_class.from_dict(dict(config))
    except Exception as e:
        return f"config.json is not a valid {config_class.__name__}: {type(e).__name__}: {e}"
    wanted = set(keys)
    tried = []
    under: Found | None = None  # the first model found under a prefix
    for cls in _candidates(tf, config, model_type):
        try:
            with torch.device("meta"):
                model = cls._from_config(cfg)
        except Exception:
            continue  # a head this config cannot build (a missing num_labels, say): not this model
        tried.append(cls.__name__)
        prefix = _prefix(set(model.state_dict()), wanted)
        if prefix == "":
            return Found(model, prefix)
        # A head model's keys hold its base model's under a prefix (`model.`): the model whose keys are
        # all the saved keys comes first, else the head (`lm_head.weight`) would be left out.
        if prefix is not None and under is None:
            under = Found(model, prefix)
    if under is not None:
        return under
    if not tried:
        return f"no transformers model could be built from config.json ({model_type})"
    return f"the saved keys are not those of {', '.join(tried)} built from config.json"


def _candidates(tf: Any, config: Mapping[str, Any], model_type: str) -> Iterator[Any]:
    """The classes `architectures` names, then every class transformers maps `model_type` to: causal LMs
    and bare models first."""
    from transformers.models.auto import modeling_auto

    names: list[str] = [a for a in config.get("architectures") or () if isinstance(a, str)]
    maps = sorted(
        (n for n in dir(modeling_auto) if n.startswith("MODEL") and n.endswith("_MAPPING_NAMES")),
        key=lambda n: (n != "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", n != "MODEL_MAPPING_NAMES", n),
    )
    for n in maps:
        entry = getattr(modeling_auto, n).get(model_type)
        names.extend([entry] if isinstance(entry, str) else list(entry or ()))
    for name in dict.fromkeys(names):
        cls = getattr(tf, name, None)
        if isinstance(cls, type) and issubclass(cls, tf.PreTrainedModel):
            yield cls


def _prefix(model_keys: set[str], saved: set[str]) -> str | None:
    """The prefix under which `saved` holds exactly `model_keys`, or None."""
    if not model_keys:
        return None
    if model_keys == saved:
        return ""
    probe = min(model_keys)
    for k in saved:
        if not k.endswith(probe):
            continue
        prefix = k[: len(k) - len(probe)]
        if prefix.endswith(".") and {s[len(prefix) :] for s in saved if s.startswith(prefix)} == model_keys:
            return prefix
    return None
