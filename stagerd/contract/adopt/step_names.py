"""The step number of a trainer's checkpoint directory, from its name.

The names trainers write (each matched whole): torchtitan `step-N`, `step_N`, the HF Trainer's
`checkpoint-N`, Accelerate's `checkpoint_I` (`automatic_checkpoint_naming`: I counts its saves),
DeepSpeed's `global_step_N` (and `global_stepN`), NeMo AutoModel's `epoch_E_step_S`, Lightning's
`epoch=E-step=S` (with its `-v1` style suffixes and an optional `.ckpt`). An operator's regex
(`--adopt-step`) is tried first: its group named `step`, else its first group.
"""

from __future__ import annotations

import re

from stagerd.contract.layout import MAX_STEP
from stagerd.errors import ConfigError

BUILTIN_STEP_NAMES = (
    r"step-(?P<step>[0-9]+)",
    r"step_(?P<step>[0-9]+)",
    r"checkpoint-(?P<step>[0-9]+)",
    r"checkpoint_(?P<step>[0-9]+)",
    r"global_step_?(?P<step>[0-9]+)",
    r"epoch_[0-9]+_step_(?P<step>[0-9]+)",
    r"epoch=[0-9]+-step=(?P<step>[0-9]+)(?:-[^/]*)?(?:\.ckpt)?",
)
_BUILTIN = tuple(re.compile(p, re.ASCII) for p in BUILTIN_STEP_NAMES)


def compile_step_regex(pattern: str | None) -> re.Pattern[str] | None:
    """An operator's step regex, checked: it must compile and have a group to take the number from."""
    if pattern is None:
        return None
    try:
        rx = re.compile(pattern)
    except re.error as e:
        raise ConfigError(f"--adopt-step {pattern!r} is not a regular expression: {e}") from None
    if rx.groups == 0:
        raise ConfigError(
            f"--adopt-step {pattern!r} has no group to take the step number from",
            hint=r"put the number in a group: 'ckpt_(\d+)' or '(?P<step>\d+)'",
        )
    return rx


def parse_step_name(name: str, custom: re.Pattern[str] | None = None) -> int | None:
    """The step number `name` gives, or None when no pattern matches it whole."""
    for rx in (custom, *_BUILTIN) if custom is not None else _BUILTIN:
        m = rx.fullmatch(name)
        if m is None:
            continue
        text = m.group("step") if "step" in rx.groupindex else m.group(1)
        if text is None or not text.isascii() or not text.isdigit():
            continue
        step = int(text)
        return step if step <= MAX_STEP else None
    return None
