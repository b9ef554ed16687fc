"""The `ModelPlan` of adopted checkpoints (`engine/adopt/model_names.py`): where config.json names a
transformers model, the plan that makes the checkpoint's tensors what that model's `save_pretrained`
writes, resolved as the training side resolves a save's from its config (`training/config_model.py`
finds the model whose live names the tensors have, `training/to_hub.py` plans its conversion).

The model is built on the meta device (no memory, no initialisation), once per checkpoint at plan time;
the last plan is kept for the next checkpoint of the same config and tensors. transformers (and torch)
are imported here only, and only for a config that names a model: a daemon without them keeps the
checkpoint's names, as does a config of no transformers model. Only a model whose keys are all the
selected names counts (a tied head the trainer left out read from its twin): a base model found under a
prefix of them is not what the checkpoint holds. Names that are already what `save_pretrained` writes
(a trainer that converts them itself) are kept as they are. Where the config's model holds neither, or its
conversion cannot be planned as byte moves, the names are kept too, with one warning per reason: not an
error, since those names are what the trainer's model holds and transformers' own `from_pretrained`
loads them, where refusing would publish nothing. A trainer whose names are its own (torchtitan's) has
them planned by its own conversion instead (`titan_names.py`), where it has one for config.json's model.
A model found by its names whose shapes are not the checkpoint's is no warning but a ModelShapeError: the
config is not the checkpoint's, and `from_pretrained` of the export could not hold its weights.

Names that no conversion is planned for (HF safetensors files, names save_pretrained's already, the
selection's kept) get from `model_plan.uncast` what the model keeps in float32 under a cast, searched in
them as `from_pretrained` searches its own names, so a cast export of them is what `save_pretrained` of
the model loaded in that dtype writes too; and from the same model (`model_plan.shapes`, built once) the
shapes it has for them, which the engine compares (`engine/adopt/config_shapes.py`). A daemon without
transformers cannot know the model's lists: its cast export casts every tensor, which it says once.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import threading
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

from stagerd.contract.hub_plan import HubPlan
from stagerd.daemon.meta_models import (
    Described,
    Tensors,
    Uncast,
    describe,
    kept_fp32,
    model_classes,
    saved_outputs,
    stand_ins,
)
from stagerd.daemon.state import log
from stagerd.engine.adopt.config_shapes import ConfigShapes, refuse_other_shapes
from stagerd.errors import HubPlanError, ModelShapeError, StagerdError

HEAD = "lm_head.weight"  # the output embedding a causal LM ties to its input one
KEPT = "the export keeps the checkpoint's own names, which may not be those save_pretrained writes"

_lock = threading.Lock()  # export threads plan one at a time: one meta model built, the next reuses it
_last: tuple[Hashable, HubPlan | None] | None = None
_last_kept: tuple[Hashable, Uncast] | None = None
_last_described: tuple[str, Described | None, str] | None = None  # config.json -> its model, or why not
_said: set[str] = set()


class _ModelPlan:
    """The `ModelPlan` handed to the adopted sources (`engine/adopt/model_names.py`)."""

    def __call__(
        self, tensors: Tensors, config: Mapping[str, Any], trainer: str | None = None
    ) -> HubPlan | None:
        return _model_plan(tensors, config, trainer)

    def uncast(self, names: Sequence[str], config: Mapping[str, Any], *, casting: bool = False) -> Uncast:
        return _uncast(names, config, casting)

    def shapes(self, config: Mapping[str, Any]) -> ConfigShapes | None:
        if not isinstance(config.get("model_type"), str):
            return None
        with _lock:
            described, _ = _described(config)
        return None if described is None else described.shapes


model_plan = _ModelPlan()


def _model_plan(tensors: Tensors, config: Mapping[str, Any], trainer: str | None) -> HubPlan | None:
    """See the module docstring: the plan over `tensors`' names, or None to keep them. A trainer whose
    names are its own (`trainer`: torchtitan's) has them planned by its own conversion (`titan_names.py`),
    or None: its preset's mapping decides."""
    global _last
    if not isinstance(config.get("model_type"), str):
        return None  # not a transformers model's config
    if trainer is not None and trainer != "torchtitan":
        return None
    key = (
        trainer,
        json.dumps(config, sort_keys=True, default=str),
        tuple(sorted((n, tuple(s), d) for n, (s, d) in tensors.items())),
    )
    with _lock:
        if _last is not None and _last[0] == key:
            return _last[1]
        try:
            plan = _resolve(tensors, config) if trainer is None else _trainers(tensors, config)
        except ModelShapeError:  # the config is not the checkpoint's: refused, not kept with a warning
            raise
        except Exception as e:  # transformers' own code, of any release: a failure there keeps the names
            _say(f"{KEPT}: planning them from config.json failed: {type(e).__name__}: {e}")
            plan = None
        _last = (key, plan)
    return plan


def _uncast(names: Sequence[str], config: Mapping[str, Any], casting: bool) -> Uncast:
    """Per cast target, which of the exported `names` (kept as the checkpoint has them) the model
    config.json names keeps in float32 there; none for another config, or where transformers cannot say
    (said once, where the export is cast: it cannot know the model's class)."""
    global _last_kept
    if not isinstance(config.get("model_type"), str):
        return ()
    key = (json.dumps(config, sort_keys=True, default=str), tuple(names))
    with _lock:
        if _last_kept is not None and _last_kept[0] == key:
            return _last_kept[1]
        kept, why = _kept(config, names)
        if kept is None:
            if casting:
                casts = "a cast export casts every tensor, those from_pretrained keeps in float32 too"
                _say(f"config.json names a {config['model_type']} model, but {why}: {casts}", logging.INFO)
            return ()
        _last_kept = (key, kept)
    return kept


def _no_transformers() -> str | None:
    """Why transformers cannot be used here, or None: it imports (and config_model then finds it among the
    loaded modules)."""
    if importlib.util.find_spec("transformers") is None:  # a sidecar without it never tries torch either
        return "transformers is not installed beside stagerd"
    try:
        import transformers  # noqa: F401
    except Exception as e:  # an install that fails to import
        return f"transformers fails to import ({type(e).__name__}: {e})"
    return None


def _kept(config: Mapping[str, Any], names: Sequence[str]) -> tuple[Uncast | None, str]:
    """`kept_fp32`, or None and why it cannot be known here."""
    described, why = _described(config)
    if described is None:
        return None, why
    try:
        return kept_fp32(described, names), ""
    except Exception as e:  # transformers' own code, of any release
        return None, f"what it keeps in float32 could not be found ({type(e).__name__}: {e})"


def _described(config: Mapping[str, Any]) -> tuple[Described | None, str]:
    """config.json's model on the meta device (`meta_models.describe`), built once for what it keeps in
    float32 and the shapes it has, and kept for the next checkpoint of the same config; or None and why
    not. The caller holds the lock."""
    global _last_described
    key = json.dumps(config, sort_keys=True, default=str)
    if _last_described is not None and _last_described[0] == key:
        return _last_described[1], _last_described[2]
    described, why = None, _no_transformers()
    if why is None:
        try:
            described = describe(config)
        except Exception as e:  # transformers' own code, of any release
            why = f"its model could not be built ({type(e).__name__}: {e})"
        else:
            why = "" if described is not None else "this transformers builds no class of it"
    _last_described = (key, described, why or "")
    return described, why or ""


def _trainers(tensors: Tensors, config: Mapping[str, Any]) -> HubPlan | None:
    """torchtitan's own conversion (`titan_names.py`), where it has one for config.json's model; None
    (with one warning where it has one but it cannot be planned) lets the preset's rules decide."""
    from stagerd.daemon.titan_names import titan_plan

    try:
        return titan_plan(tensors, config)
    except Exception as e:  # torchtitan's and transformers' own code, of any release
        why = e.message if isinstance(e, StagerdError) else f"{type(e).__name__}: {e}"
        _say(f"torchtitan's {config['model_type']} adapter could not plan its names: {why}")
        return None


def _resolve(tensors: Tensors, config: Mapping[str, Any]) -> HubPlan | None:
    if (why := _no_transformers()) is not None:
        _say(f"config.json names a {config['model_type']} model, but {why}; {KEPT}", logging.INFO)
        return None
    from stagerd.training import to_hub

    try:
        sd = stand_ins(tensors)
    except HubPlanError as e:
        _say(f"{e.message}; {KEPT}")
        return None
    found = _whole_model(config, sd)
    if isinstance(found, str):
        if not _saved_already(config, set(sd)):  # AutoModel's own MoE models save the Hub's names
            _say(f"{KEPT}: {found}")
        return None
    if found is None:
        return None
    own = found[0].model.state_dict()  # the model whose names these are: its shapes must be theirs too
    want = ConfigShapes(type(found[0].model).__name__, {k: (tuple(t.shape),) for k, t in own.items()})
    refuse_other_shapes(((n, n, tuple(t.shape)) for n, t in sd.items()), want)
    try:
        return to_hub.prefixed_plan(found[0], sd, found[1])
    except StagerdError as e:
        _say(f"{KEPT}: {e.message}")
        return None


def _whole_model(config: Mapping[str, Any], sd: Mapping[str, Any]) -> tuple[Any, dict[str, str]] | str | None:
    """The model config.json describes whose keys are all the selected tensors' names, with the tied head
    a trainer left out (AutoModel saves a tied `lm_head.weight` once, as its embedding) read from its twin;
    why not, for a config of a transformers model; None for another config. Only the whole selection: a
    model found under a prefix (its base model, say) is not what the checkpoint holds."""
    from stagerd.training import config_model

    found = config_model.from_config(config, list(sd))
    if not _exact(found) and HEAD not in sd:
        again = config_model.from_config(config, [*sd, HEAD])
        if isinstance(again, config_model.Found) and not again.prefix:
            own = again.model.state_dict(keep_vars=True)
            twin = next((k for k, v in own.items() if k != HEAD and v is own[HEAD]), None)
            if twin is not None and twin in sd:
                return again, {HEAD: twin}
    if isinstance(found, config_model.Found) and found.prefix:
        name = type(found.model).__name__
        return f"the selected tensors hold {name} under {found.prefix!r}, not the model config.json names"
    if isinstance(found, config_model.Found):
        return found, {}
    return found


def _saved_already(config: Mapping[str, Any], names: set[str]) -> bool:
    """Whether `names` are those `save_pretrained` writes of the model config.json names (its
    `architectures`, else its model_type's causal LM or bare model; a tied head there or not): a trainer
    that saves them needs no conversion, nor a warning."""
    for cls in model_classes(config):
        saved = _save_names(cls, config)
        if saved is not None and names - {HEAD} == saved - {HEAD}:
            return True
    return False


def _save_names(cls: Any, config: Mapping[str, Any]) -> set[str] | None:
    """The names `save_pretrained` writes of `cls` built from `config` on the meta device, or None."""
    try:
        return set(saved_outputs(cls, config)[1])
    except Exception:  # an unknown model_type, a model this config cannot build, a conversion not planned
        return None


def _exact(found: object) -> bool:
    from stagerd.training import config_model

    return isinstance(found, config_model.Found) and not found.prefix


def _say(message: str, level: int = logging.WARNING) -> None:
    """Once per distinct message in a daemon: every checkpoint of a training would say the same."""
    message = " ".join(message.split())  # an exception's text may run over lines: one line in the log
    if message not in _said:
        _said.add(message)
        log.log(level, "%s", message)
