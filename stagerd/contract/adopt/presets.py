"""Per-trainer presets: where a trainer's checkpoint keeps the model, when it is finished, which of its
tensors are the model, and how their names become the Hugging Face checkpoint's.

A preset is data. `select` is matched whole against every tensor key of the checkpoint; a key it matches
is a model tensor, named by the pattern's group `name` (else its first group, else the key itself), and
every other key (optimizer state, schedulers, RNG, dataloader) is left alone. The names then go through a
key mapping (`contract/key_mapping.py`, strict where the preset knows the model's names), whose
`rope_heads` may name a config.json field instead of a number. `resolve_selection` turns all of it into
the to-Hub plan the export engine carries out, or a named error at plan time: nothing selected, two keys
giving one name, a selected key the strict mapping leaves unmapped, names PEFT's loader would not take
(`peft_names.py`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any

from stagerd.contract.adopt.peft_names import refuse_grouped_expert_lora, refuse_peft_names
from stagerd.contract.adopt.torchtitan_names import TORCHTITAN_LLAMA_RULES
from stagerd.contract.hub_plan import HubPlan, TensorView
from stagerd.contract.key_mapping import KeyMapping
from stagerd.contract.layout import ADAPTER_WEIGHTS_NAME, INDEX_NAME, WEIGHTS_NAME
from stagerd.contract.pickle_depth import show
from stagerd.errors import AdoptError, ConfigError, ModelConfigError

METADATA = ".metadata"
MAX_HEADS = 1 << 16  # a config.json's head count past it is no model's (and thousands of digits long)
ADAPTER_CONFIG = "adapter_config.json"
# PEFT's model card (`library_name: peft`, `base_model`), what push_to_hub publishes: taken from the
# checkpoint only (ROOT's README.md may be the user's own).
ADAPTER_CARD = "README.md"


class Format(StrEnum):
    """How the model's tensors are stored: FileSystemWriter (`.metadata` + `.distcp`),
    HuggingFaceStorageWriter's sharded safetensors (DCP_SHARDING_INFO in each header, no `.metadata`), or
    whole tensors in HF files with their index (torchtitan's `last_save_in_hf`, a Trainer without FSDP)."""

    DCP = "dcp"
    HF_SHARDS = "hf-shards"
    HF_FILES = "hf-files"  # already a Hugging Face checkpoint: `model.safetensors[.index.json]`


@dataclass(frozen=True)
class Preset:
    """How one trainer writes its checkpoints (see the module docstring)."""

    name: str
    model_dir: str = "."  # the model's directory, relative to the checkpoint directory
    format: Format = Format.DCP
    complete: tuple[str, ...] = ()  # files (relative to the checkpoint directory) the trainer writes last
    incomplete: str | None = None  # a file the trainer removes last: present, the checkpoint is not finished
    zips: tuple[str, ...] = ()  # completion zip archives: finished once their directory reads
    jsons: tuple[str, ...] = ()  # completion files written in place as JSON: finished once they parse
    select: str = r"(?P<name>.+)"
    select_fallback: str | None = None  # used when `select` matches no key (plain dcp: no `model.` prefix)
    mapping: Mapping[str, Any] | None = None
    tied: tuple[str, ...] = ()  # output names save_pretrained leaves out when tie_word_embeddings is set
    detect_paths: tuple[str, ...] = ()  # auto: one of these exists in the checkpoint directory
    detect_key: str | None = None  # auto: a key of the checkpoint's `.metadata` matches this whole
    detect_name: str | None = None  # the checkpoint directory's name matches this whole
    detect_also: tuple[str, ...] = ()  # auto: each of these exists too
    extras_dirs: tuple[str, ...] = ()  # where the trainer keeps config.json (relative), searched first
    adapter: bool = False  # HF files that are a PEFT adapter: `adapter_model.safetensors`, no index
    description: str = ""

    def metadata_file(self) -> str:
        return METADATA if self.model_dir == "." else f"{self.model_dir}/{METADATA}"

    def completion_files(self) -> tuple[str, ...]:
        """Every file that must exist before the checkpoint is finished (`.metadata` first for DCP)."""
        return (self.metadata_file(), *self.complete) if self.format is Format.DCP else self.complete


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset(
            "hf-trainer",
            model_dir="pytorch_model_fsdp_0",
            complete=("trainer_state.json",),
            jsons=("trainer_state.json",),
            select=r"model\.(?P<name>.+)",
            tied=("lm_head.weight",),
            detect_paths=("pytorch_model_fsdp_0",),
            description="HF Trainer / Accelerate FSDP, SHARDED_STATE_DICT: checkpoint-N/pytorch_model_fsdp_0",
        ),
        Preset(
            "automodel",
            model_dir="model",
            format=Format.HF_SHARDS,
            incomplete=".incomplete",
            detect_paths=(".incomplete", "model/.hf_metadata"),
            extras_dirs=("model/.hf_metadata",),
            tied=("lm_head.weight",),
            description="NeMo AutoModel, save_consolidated: false: epoch_E_step_S/model (HF shards)",
        ),
        Preset(
            "lightning",
            complete=("meta.pt",),
            zips=("meta.pt",),
            select=r"(?:state_dict|model)\.model\.(?P<name>.+)",
            tied=("lm_head.weight",),
            detect_key=r"state_dict\..+",
            description="Lightning FSDP / ModelParallel: epoch=E-step=S.ckpt/ (the module's `model`)",
        ),
        Preset(
            "torchtitan",
            select=r"(?!(?:optimizer|lr_scheduler|dataloader|train_state)(?:\.|$))(?P<name>.+)",
            mapping={"strict": True, "rules": TORCHTITAN_LLAMA_RULES},
            tied=("lm_head.weight",),
            detect_key=r"tok_embeddings\.weight",
            description="torchtitan CheckpointManager: checkpoint.folder/step-N (Llama 3; Qwen3, DSV3 to_hf)",
        ),
        Preset(
            "hf",
            format=Format.HF_FILES,
            tied=("lm_head.weight",),
            detect_paths=(INDEX_NAME, WEIGHTS_NAME),
            description="HF safetensors already (torchtitan's last_save_in_hf): cast, published as they are",
        ),
        Preset(
            "dcp",
            select=r"model\.(?P<name>.+)",
            select_fallback=r"(?P<name>.+)",
            tied=("lm_head.weight",),
            description="any dcp.save / dcp.async_save: the tensors under `model.`, else every tensor",
        ),
    )
}
# The HF Trainer without FSDP (DDP, one process) writes `save_pretrained`'s files first, then the
# tokenizer, optimizer and RNG states, and `trainer_state.json` last: whole safetensors in a `checkpoint-N`
# are a save still being written, which exported then would lack the tokenizer and never get it.
HF_TRAINER_FILES = Preset(
    "hf-trainer",
    format=Format.HF_FILES,
    complete=("trainer_state.json",),
    jsons=("trainer_state.json",),
    tied=("lm_head.weight",),
    detect_paths=(INDEX_NAME, WEIGHTS_NAME),
    detect_name=r"checkpoint-[0-9]+",
    description="HF Trainer without FSDP (DDP, one process): checkpoint-N/model.safetensors",
)
# The Trainer (or TRL's SFTTrainer) training a PeftModel saves the adapter alone, as
# `PeftModel.save_pretrained` writes it (`adapter_model.safetensors`, `adapter_config.json`), then the
# tokenizer, optimizer and RNG states, and `trainer_state.json` last. Its tensors carry PEFT's own names:
# published as they are, `PeftModel.from_pretrained(base, DIR)` loads them.
HF_TRAINER_ADAPTER = replace(
    HF_TRAINER_FILES,
    tied=(),
    detect_paths=(ADAPTER_WEIGHTS_NAME,),
    adapter=True,
    description="HF Trainer / TRL with a PEFT model: checkpoint-N/adapter_model.safetensors",
)
# The Trainer (or TRL) training a PeftModel under FSDP with SHARDED_STATE_DICT saves the adapter alone in
# DCP (Accelerate's `adapter_only`), under `model.` and the names `PeftModel.save_pretrained` gives, and no
# adapter_config.json: published as PEFT writes it once one is found (--extras DIR). A PEFT model's whole
# state dict names its factors `lora_A.default.weight`, which this layout's key never matches.
HF_TRAINER_DCP_ADAPTER = replace(
    PRESETS["hf-trainer"],
    tied=(),
    detect_key=r"model\..+\.lora_(?:A|B|embedding_A|embedding_B)\.weight",
    adapter=True,
    description="HF Trainer / TRL with a PEFT model under FSDP SHARDED_STATE_DICT: the adapter in DCP",
)
# Accelerate's own `save_state` (a loop of the user's): the model first, its FSDP SHARDED directory or
# `model.safetensors`, then the optimizer, and every rank's `random_states_R.pkl`; no trainer_state.json,
# so the Trainer's completion rule would wait for good. Its `.metadata` (its whole files) finishes it.
ACCELERATE = Preset(
    "accelerate",
    model_dir="pytorch_model_fsdp_0",
    select=r"model\.(?P<name>.+)",
    tied=("lm_head.weight",),
    detect_paths=("pytorch_model_fsdp_0",),
    detect_also=("random_states_0.pkl",),
    description="Accelerate save_state, FSDP SHARDED_STATE_DICT: DIR/pytorch_model_fsdp_0",
)
ACCELERATE_FILES = replace(
    ACCELERATE,
    model_dir=".",
    format=Format.HF_FILES,
    select=r"(?P<name>.+)",
    detect_paths=(INDEX_NAME, WEIGHTS_NAME),
    description="Accelerate save_state without FSDP: DIR/model.safetensors",
)
# AutoModel with `model_save_format: torch_save`: `model/` is a FileSystemWriter save of the HF names (no
# `.hf_metadata/`, so no config.json of its own), finished, as its safetensors are, when `.incomplete` goes.
AUTOMODEL_DCP = Preset(
    "automodel",
    model_dir="model",
    incomplete=".incomplete",
    tied=("lm_head.weight",),
    detect_paths=("model/.metadata",),
    detect_name=r"epoch_[0-9]+_step_[0-9]+",
    description="NeMo AutoModel, model_save_format: torch_save: epoch_E_step_S/model (DCP)",
)
# AutoModel training a PEFT model (`is_peft`) saves the adapter alone, as PEFT's `save_pretrained` names it,
# in `model/` beside its adapter_config.json and the tokenizer, with no `.hf_metadata/`; `.incomplete` goes
# last, as for its other saves.
AUTOMODEL_ADAPTER = replace(
    HF_TRAINER_ADAPTER,
    name="automodel",
    model_dir="model",
    complete=(),
    jsons=(),
    incomplete=".incomplete",
    detect_paths=(f"model/{ADAPTER_WEIGHTS_NAME}",),
    detect_name=r"epoch_[0-9]+_step_[0-9]+",
    extras_dirs=("model",),
    description="NeMo AutoModel with PEFT: epoch_E_step_S/model/adapter_model.safetensors",
)
# Lightning's FSDPStrategy saves the module's state dict under `model.` (ModelParallelStrategy under
# `state_dict.`), so its keys alone look like a plain dcp.save's, whose preset needs no meta.pt and would
# export the save before it is finished, the module's `model.` left in every name. Every Lightning save
# is named `*.ckpt`: a DCP directory of that name holding `model.` keys is Lightning's.
LIGHTNING_FSDP = replace(PRESETS["lightning"], detect_key=r"model\..+", detect_name=r".+\.ckpt")
# The layouts one preset name covers, tried in this order (the first whose paths exist, else the first).
LAYOUTS: dict[str, tuple[Preset, ...]] = {
    **{name: (p,) for name, p in PRESETS.items()},
    "hf-trainer": (HF_TRAINER_DCP_ADAPTER, PRESETS["hf-trainer"], HF_TRAINER_FILES, HF_TRAINER_ADAPTER),
    "accelerate": (ACCELERATE, ACCELERATE_FILES),
    "automodel": (PRESETS["automodel"], AUTOMODEL_DCP, AUTOMODEL_ADAPTER),
    "lightning": (PRESETS["lightning"], LIGHTNING_FSDP),
}
AUTO = "auto"
# Tried in this order by --adopt auto; the first whose layout (and key, where it names one) fits wins.
AUTO_ORDER = ("accelerate", "hf-trainer", "automodel", "lightning", "torchtitan", "dcp", "hf")


# What from_pretrained and tokenizers read beside the weights; copied into the export where found.
HF_EXTRAS = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "spiece.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "preprocessor_config.json",
    "processor_config.json",
)
# A PEFT adapter's export is what `PeftModel.save_pretrained` writes (its config, no base config.json: the
# adapter's config names the base model) with the tokenizer the Trainer saved beside it.
ADAPTER_EXTRAS = (
    ADAPTER_CONFIG,
    *(n for n in HF_EXTRAS if n not in ("config.json", "generation_config.json")),
    ADAPTER_CARD,
)


def extra_names(preset: Preset) -> tuple[str, ...]:
    """The files copied beside the weights where found (see `find_extras`)."""
    return ADAPTER_EXTRAS if preset.adapter else HF_EXTRAS


def preset_names() -> tuple[str, ...]:
    return (AUTO, *LAYOUTS)


def get_preset(name: str) -> Preset:
    try:
        return LAYOUTS[name][0]
    except KeyError:
        raise unknown_preset(name) from None


def unknown_preset(name: str, *, no_root: bool = False) -> ConfigError:
    """The error for a preset name none has: with the closest one (`hf_trainer`: hf-trainer), or, for a
    path (or any name, where the command line gave no ROOT: `no_root`), that `--adopt` took ROOT as its
    preset (its value is optional, so `--adopt ROOT` gives it ROOT)."""
    import difflib

    close = difflib.get_close_matches(name.strip().lower().replace("_", "-"), preset_names(), n=1, cutoff=0.6)
    if close:
        hint = f"did you mean {close[0]}?"
    elif no_root or "/" in name or name in (".", ".."):
        hint = (
            "--adopt takes its PRESET as its next word, so it took ROOT as one: put ROOT first "
            "(`stagerd watch ROOT --adopt`), or name the preset (`--adopt auto ROOT`)"
        )
    else:
        hint = "name one of them, or use --adopt dcp with --adopt-select REGEX"
    return ConfigError(f"no adopt preset {name!r}; the presets are {', '.join(preset_names())}", hint=hint)


def _compile(pattern: str, what: str) -> re.Pattern[str]:
    try:
        return re.compile(pattern)
    except re.error as e:
        raise ConfigError(f"{what} {pattern!r} is not a regular expression: {e}") from None


def _name(rx: re.Pattern[str], m: re.Match[str]) -> str:
    if "name" in rx.groupindex:
        return m.group("name")
    return m.group(1) if rx.groups else m.group(0)


def select_keys(preset: Preset, keys: list[str], select: str | None = None) -> dict[str, str]:
    """model name -> DCP key of every selected tensor; an empty or ambiguous selection is an AdoptError."""
    patterns = [select] if select is not None else [preset.select, preset.select_fallback]
    for pattern in (p for p in patterns if p is not None):
        rx = _compile(pattern, "--adopt-select" if select is not None else f"preset {preset.name} select")
        chosen: dict[str, str] = {}
        for key in keys:
            m = rx.fullmatch(key)
            if m is None:
                continue
            name = _name(rx, m)
            if name in chosen:
                raise AdoptError(
                    f"keys {chosen[name]!r} and {key!r} would both be model tensor {name!r}",
                    hint="narrow the selection with --adopt-select REGEX",
                )
            chosen[name] = key
        if chosen:
            return chosen
    what = f"--adopt-select {select!r}" if select is not None else f"preset {preset.name}"
    raise AdoptError(
        f"{what} selects no tensor of this checkpoint (its keys start {sorted(keys)[:4]})",
        hint="name the model's keys with --adopt-select REGEX, the model's tensor name its group 1 or "
        "(?P<name>...): e.g. 'state_dict\\.net\\.(.+)' where a LightningModule holds its model as self.net "
        "('model\\.net\\.(.+)' under its FSDPStrategy)",
    )


def preset_mapping(preset: Preset, config: Mapping[str, Any] | None) -> KeyMapping | None:
    """The preset's key mapping, with `rope_heads` that name a config.json field resolved from it."""
    if preset.mapping is None:
        return None
    rules = []
    for rule in preset.mapping["rules"]:
        heads = rule.get("rope_heads")
        if isinstance(heads, str):
            value = (config or {}).get(heads)
            if heads == "num_key_value_heads" and value is None:
                value = (config or {}).get("num_attention_heads")
            if config is None:
                raise ModelConfigError(
                    f"preset {preset.name} needs the model's config.json (its {heads} orders the RoPE "
                    "rows), and none was found beside the checkpoint, in --extras DIR or in the directory "
                    "above it"
                )
            if not isinstance(value, int) or isinstance(value, bool) or not 0 < value <= MAX_HEADS:
                raise ModelConfigError(
                    f"preset {preset.name} needs config.json's {heads} (a head count) for the RoPE "
                    f"row order; config.json gives {show(value)}"
                )
            rule = {**rule, "rope_heads": value}
        rules.append(rule)
    return KeyMapping.load({**preset.mapping, "rules": rules}, source=f"preset {preset.name}")


def resolve_selection(
    preset: Preset,
    shapes: Mapping[str, tuple[int, ...]],
    *,
    select: str | None = None,
    mapping: KeyMapping | None = None,
    config: Mapping[str, Any] | None = None,
) -> tuple[list[str], HubPlan]:
    """The DCP keys to read and the to-Hub plan over them (sources are DCP keys, names the Hub's).

    `mapping` (an operator's --mapping) replaces the preset's. A tied head save_pretrained leaves out is
    dropped when config.json says `tie_word_embeddings`."""
    chosen = select_keys(preset, list(shapes), select)
    km = mapping if mapping is not None else preset_mapping(preset, config)
    named = {name: tuple(shapes[key]) for name, key in chosen.items()}
    plan = km.resolve(named) if km is not None else HubPlan((), (), origin="mapping")
    views = [replace(v, source=chosen[v.source]) for v in plan.views]
    viewed = {v.source for v in plan.views}
    views += [_whole(name, chosen[name], named[name]) for name in chosen if name not in viewed]
    if config is not None and config.get("tie_word_embeddings") is True:
        views = [v for v in views if v.name not in preset.tied]  # save_pretrained leaves the head out
    if preset.adapter:
        refuse_grouped_expert_lora([v.name for v in views])
    else:
        refuse_peft_names([v.name for v in views])
    hub = HubPlan(tuple(views), (), origin="mapping")
    hub.outputs({key: tuple(shapes[key]) for key in chosen.values()})  # two outputs of one name: now
    return sorted({v.source for v in views}), hub


def _whole(name: str, key: str, shape: tuple[int, ...]) -> TensorView:
    return TensorView(name, key, (0,) * len(shape), shape, shape)
