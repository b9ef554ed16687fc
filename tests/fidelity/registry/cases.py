"""The installed transformers as the test list: every entry of its checkpoint conversion registry, and
every causal-LM model type that ties its embeddings, each as a case (model type, class to build, tied).

Nothing here is a list of one transformers version's models: the cases are read from the installed
registry and auto mappings. Only `UNBUILDABLE` names model types, each with the reason a tiny model of it
cannot be built; `test_list.py` asserts every reason, and tolerates types a version lacks.
"""

from __future__ import annotations

import functools
import re
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Auto mappings whose class is built for a model type, most wanted first: causal LM, image-text, then the
# bare model, then any head transformers has for it.
_PREFERRED = (
    "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES",
    "MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES",
    "MODEL_MAPPING_NAMES",
)
SHARDS = 4  # test_shard_<k>.py, k < SHARDS: files xdist spreads over its workers


@dataclass(frozen=True)
class Case:
    model_type: str
    cls: str  # the transformers class built
    tied: bool = False  # built with tie_word_embeddings
    over: tuple[tuple[str, Any], ...] = ()  # config fields set on top of the tiny config

    @property
    def id(self) -> str:
        extra = "".join(f"-{k}={v}" for k, v in self.over)
        named = "" if self.cls == class_for(self.model_type) else f"-{self.cls}"
        return f"{self.model_type}{named}{'-tied' if self.tied else ''}{extra}"

    @property
    def shard(self) -> int:
        return zlib.crc32(self.id.encode()) % SHARDS


@functools.cache
def registry() -> dict[str, Any]:
    """The installed transformers' conversion registry: model type or class name -> its transforms."""
    from transformers.conversion_mapping import _build_checkpoint_conversion_mapping

    return dict(_build_checkpoint_conversion_mapping())


@functools.cache
def _mappings() -> dict[str, dict[str, str]]:
    import transformers.models.auto.modeling_auto as auto

    out = {}
    for name in dir(auto):
        d = getattr(auto, name)
        if name.endswith("_MAPPING_NAMES") and isinstance(d, dict):
            out[name] = {k: (v[0] if isinstance(v, list | tuple) else v) for k, v in d.items()}
    return out


def model_types() -> set[str]:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    return set(CONFIG_MAPPING_NAMES)


def class_for(model_type: str) -> str | None:
    """The class a case of `model_type` builds: causal LM, image-text, the bare model, else any head."""
    maps = _mappings()
    for name in (*_PREFERRED, *sorted(maps)):
        if name != "CONFIG_MAPPING_NAMES" and isinstance(maps[name].get(model_type), str):
            return maps[name][model_type]
    return None


def model_type_of_class(cls: str) -> str | None:
    """The model type whose auto mappings name class `cls` (without importing it)."""
    for name, d in _mappings().items():
        if name == "CONFIG_MAPPING_NAMES":
            continue
        for mt, c in d.items():
            if c == cls:
                return mt
    return None


def cases() -> list[Case]:
    """Every case: a registry key that is a model type with a class; a registry key that is a class the
    auto mappings know, unless it is its model type's case's class or the base model inside it; every
    causal-LM model type, tied (where its class can tie: `can_tie`, asked when the case runs, so that
    collecting the cases imports no model code)."""
    out: dict[str, Case] = {}
    reg, types, maps = registry(), model_types(), _mappings()
    for key in reg:
        mt = key if key in types else model_type_of_class(key)
        if mt is None:  # a sub-model's class: the models of the package defining it hold one
            for parent in sorted(t for t in types if package_of_type(t) == class_packages().get(key)):
                if class_for(parent) is not None:
                    out.setdefault(parent, Case(parent, class_for(parent)))  # type: ignore[arg-type]
            continue
        if class_for(mt) is None:
            continue
        cls = class_for(mt)
        if key not in types and key != maps["MODEL_MAPPING_NAMES"].get(mt):
            cls = key
        case = Case(mt, cls)  # type: ignore[arg-type]
        out.setdefault(case.id, case)
    for mt, cls in maps["MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"].items():
        if mt in types:
            tied = Case(mt, cls, tied=True)
            out.setdefault(tied.id, tied)
    for case in EXTRA:
        if case.model_type in types:
            out.setdefault(case.id, case)
    return sorted(out.values(), key=lambda c: (c.id, c.cls))


@functools.cache
def class_packages() -> dict[str, str]:
    """Class name -> the transformers.models package defining it (read from the sources, not imported)."""
    import transformers

    out: dict[str, str] = {}
    for f in sorted((Path(transformers.__file__).parent / "models").glob("*/modeling_*.py")):
        for name in re.findall(r"^class (\w+)\(", f.read_text(), re.M):
            out.setdefault(name, f.parent.name)
    return out


@functools.cache
def package_of_type(model_type: str) -> str:
    from transformers.models.auto.configuration_auto import model_type_to_module_name

    return str(model_type_to_module_name(model_type))


def can_tie(model: Any) -> bool:
    """The model declares tied weights (its embeddings and output layer can be one tensor)."""
    return bool(getattr(type(model), "_tied_weights_keys", None))


# Cases beyond the registry's defaults: Inkling2's vocabulary with and without padding rows.
EXTRA = (
    Case("inkling2_text", "Inkling2ForCausalLM", over=(("unpadded_vocab_size", 64),)),
    Case("inkling2_loop_text", "Inkling2LoopForCausalLM", over=(("unpadded_vocab_size", 64),)),
)


# Cases a tiny model cannot be built for here, by case id: (a regex of what building it raises, as
# "ExceptionName: message"; why). `test_list.py` builds each one present in the installed transformers
# and asserts it still fails so: a type that starts to build leaves this list.
_TIMM = ("ImportError: .*requires the timm library", "its backbone is a timm model; timm is not installed")
_PIL = ("ImportError: .*requires the PIL library", "its vision tower is a timm model; no timm, no pillow")
_BIG = ("TooBig: ", "its convolution stacks keep hundreds of channels in a tiny config: not a tiny model")
_STAGES = ("TypeError|AttributeError|IndexError", "its heads index backbone stages a tiny backbone lacks")
_GROUPS = ("ValueError: .*divisible by groups", "an audio codec whose convolution groups need wide channels")
UNBUILDABLE: dict[str, tuple[str, str]] = {
    "conditional_detr": _TIMM,
    "deformable_detr": _TIMM,
    "detr": _TIMM,
    "detr-DetrForSegmentation": _TIMM,
    "gemma3n-tied": _PIL,
    "timm_wrapper": _PIL,
    "beit-BeitForSemanticSegmentation": ("ValueError: .*out_indices", "its head needs 4 backbone stages"),
    "d_fine": _STAGES,
    "lw_detr": ("StrictDataclassClassValidationError: .*num_windows", "its windows need a large image"),
    "mimi": _GROUPS,
    "mimi_decoder": _GROUPS,
    "mimi_encoder": _BIG,
    "maskformer": _BIG,
    "pp_doclayout_v2": _BIG,
    "pp_doclayout_v3": _BIG,
    "pp_doclayout_v4": _BIG,
    "rt_detr": _BIG,
    "rt_detr_v2": _BIG,
    "sam3_tracker_video": _BIG,
    "tipsv2_dpt": _BIG,
    "tipsv2_dpt-Tipsv2DptForNormalEstimation": _BIG,
    "tipsv2_dpt-Tipsv2DptForSemanticSegmentation": _BIG,
    "vibevoice_asr": _BIG,
    "qwen3_omni_moe": (_BIG[0], "its speech talker and codec: " + _BIG[1] + " (its thinker is a case)"),
    **{
        f"sapiens2-Sapiens2For{head}": _STAGES
        for head in (
            "ImageMatting",
            "NormalEstimation",
            "PointmapEstimation",
            "PoseEstimation",
            "SemanticSegmentation",
        )
    },
}


def params(shard: int) -> list[Case]:
    """The cases of test_registry_<shard>.py: those that build."""
    return [c for c in cases() if c.shard == shard and c.id not in UNBUILDABLE]
