"""What a `--once` run says of the saves it found unfinished and left alone: a Stager step directory without
its commit marker, an adopted checkpoint its preset does not find finished. A running daemon says nothing
of them (the trainer may still be writing it, and the next scan takes it up); a `--once` run ends before
that, and a save a killed trainer left half-written would otherwise be passed over in silence, run after
run. Its summary names the newest few once, each with what "finished" needs, and how many there are."""

from __future__ import annotations

from typing import NamedTuple

from stagerd.contract.adopt.presets import Format, Preset
from stagerd.contract.layout import MARKER_NAME

MARKER_RULE = f"committed once its {MARKER_NAME} exists: the Stager writes it last, after every rank's save"
NO_PRESET_RULE = (
    "no --adopt preset recognises it yet: a DCP checkpoint is recognised once its .metadata exists, written "
    "after every rank's data; HF safetensors once their files exist"
)


class Unfinished(NamedTuple):
    """A save seen in ROOT and left alone: its step, its directory's name, and the rule it does not meet."""

    step: int
    name: str
    rule: str


def finished_rule(preset: Preset) -> str:
    """`hf-trainer: finished once pytorch_model_fsdp_0/.metadata and a whole trainer_state.json exist`:
    the preset's completion rule (`engine/adopt/finished.py`), as README's table says it."""
    whole = {*preset.zips, *preset.jsons}
    files = [f"a whole {f}" if f in whole else f for f in preset.completion_files()]
    where = "" if preset.model_dir == "." else f" in {preset.model_dir}/"
    parts = []
    if preset.format is Format.HF_FILES:
        parts.append(f"its safetensors files{where} are whole (the index parses)")
    elif preset.format is Format.HF_SHARDS:
        parts.append(f"{preset.model_dir}/ holds its safetensors shards")
    if files:
        parts.append(" and ".join(files) + (" exists" if len(files) == 1 else " exist"))
    if preset.incomplete is not None:
        parts.append(f"its {preset.incomplete} file is gone")
    return f"{preset.name}: finished once {', and '.join(parts)}"


def newest_of(found: list[Unfinished], listed: int) -> list[Unfinished]:
    """The `listed` newest of `found` (by step, then name), ascending."""
    return sorted(found)[-listed:] if listed > 0 else []


def unfinished_text(count: int, shown: list[Unfinished], adopt: bool, then: str = "the next run") -> str:
    """One line: the saves this run (or a daemon's last scan) left alone as unfinished, grouped by the rule
    each does not meet; `then` takes them up."""
    by_rule: dict[str, list[str]] = {}
    for u in shown:
        by_rule.setdefault(u.rule, []).append(u.name)
    names = "; ".join(f"{', '.join(n)} ({rule})" for rule, n in by_rule.items())
    which = f", the newest {len(shown)}" if count > len(shown) else ""
    what, done = ("checkpoint", "finished") if adopt else ("step", "committed")
    return (
        f"{count} {what}(s) not {done}, left alone{which}: {names}. Their tensors were not read and nothing "
        f"of them was published; {then} takes each up once it is {done}"
    )
