"""The `ModelPlan` of adopted checkpoints (`engine/adopt/model_names.py`): where config.json names a
transformers model, the plan that makes the checkpoint's tensors what that model's `save_pretrained`
writes, resolved as the training side resolves a save's from its config (`training/config_model.py`
finds the model whose live names the tensors have, `training/to_hub.py` plans its conversion).

The model is built on the meta device (no memory, no initialisation), once per checkpoint at plan time;
the last plan is kept for the next checkpoint of the same config and tensors. transformers (and torch)
are imported here only, and only for a config that names a model: a daemon without them keeps the
checkpoint's names, as does a config of no transformers model. Where the config's model does not hold the
selected tensors, or its conversion cannot be planned as byte moves, the names are kept too, with one
warning per reason: not an error, since those names are what the trainer's model holds and transformers'
own `from_pretrained` loads them, where refusing would publish nothing.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Hashable, Mapping
from typing import Any

from stagerd.contract import dtypes
from stagerd.contract.hub_plan import HubPlan
from stagerd.daemon.state import log
from stagerd.errors import StagerdError

Tensors = Mapping[str, tuple[tuple[int, ...], str]]  # name -> (global shape, safetensors dtype)
KEPT = "the export keeps the checkpoint's own names, which may not be those save_pretrained writes"

_lock = threading.Lock()  # export threads plan one at a time: one meta model built, the next reuses it
_last: tuple[Hashable, HubPlan | None] | None = None
_said: set[str] = set()


def model_plan(tensors: Tensors, config: Mapping[str, Any]) -> HubPlan | None:
    """See the module docstring: the plan over `tensors`' names, or None to keep them."""
    global _last
    if not isinstance(config.get("model_type"), str):
        return None  # not a transformers model's config
    key = (
        json.dumps(config, sort_keys=True, default=str),
        tuple(sorted((n, tuple(s), d) for n, (s, d) in tensors.items())),
    )
    with _lock:
        if _last is not None and _last[0] == key:
            return _last[1]
        plan = _resolve(tensors, config)
        _last = (key, plan)
    return plan


def _resolve(tensors: Tensors, config: Mapping[str, Any]) -> HubPlan | None:
    try:
        import torch
        import transformers  # noqa: F401  config_model finds it among the loaded modules
    except Exception as e:  # not installed, or an install that fails to import: the names are kept
        _say(f"config.json names a {config['model_type']} model, but transformers cannot be imported "
             f"({type(e).__name__}); {KEPT}", logging.INFO)  # fmt: skip
        return None
    from stagerd.training import config_model, to_hub

    sd = {}
    for name, (shape, dt) in tensors.items():
        torch_name = dtypes.lookup(dt).torch_name
        if torch_name is None:
            _say(f"{name!r} is {dt}, which torch has no dtype for; {KEPT}")
            return None
        sd[name] = torch.empty(shape, dtype=getattr(torch, torch_name), device="meta")
    found = config_model.from_config(config, list(sd))
    if isinstance(found, str):
        _say(f"{KEPT}: {found}")
        return None
    if found is None:
        return None
    try:
        return to_hub.prefixed_plan(found, sd, {})
    except StagerdError as e:
        _say(f"{KEPT}: {e.message}")
        return None


def _say(message: str, level: int = logging.WARNING) -> None:
    """Once per distinct message in a daemon: every checkpoint of a training would say the same."""
    if message not in _said:
        _said.add(message)
        log.log(level, "%s", message)
