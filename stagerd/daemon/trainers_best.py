"""The step the Hugging Face Trainer names its best (`best_model_checkpoint` in the newest
`trainer_state.json`), which `load_best_model_at_end` reads back when the training ends: retention keeps
it as a pinned step, also between a training's end and its resume, when no trainer holds a pin. Read in
the io thread."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path

from stagerd.contract import layout
from stagerd.errors import StagerdError

STATE_FILE = "trainer_state.json"


def named_best(
    root: Path, states: Iterable[tuple[int, Path]], step_of: Callable[[str], int | None]
) -> set[int]:
    """The step the newest readable state of `states` ((step, trainer_state.json)) names best, where its
    directory is under `root`: its name, not the recorded path, which may be another node's mount."""
    from stagerd.engine.parsed_extras import read_json_object

    for _, path in sorted(states, reverse=True):  # the newest that parses: one still being written is skipped
        try:
            best = read_json_object(path).get("best_model_checkpoint")
        except StagerdError:
            continue
        if not isinstance(best, str):
            return set()
        step = step_of(Path(best).name)
        return {step} if step is not None and (root / Path(best).name).is_dir() else set()
    return set()


def adopted_best(root: Path, step_of: Callable[[str], int | None]) -> set[int]:
    """The Trainer's own checkpoints (`checkpoint-N/trainer_state.json`), as `--adopt` reads them."""
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return set()
    states = [(s, root / n / STATE_FILE) for n in names if (s := step_of(n)) is not None]
    return named_best(root, [(s, p) for s, p in states if p.is_file()], step_of)


def staged_best(root: Path) -> set[int]:
    """Steps the Stager's Trainer callback saved (`step-N/extras/trainer_state.json`), which records the
    best as `ROOT/step-M`."""
    states = [(s, p / layout.EXTRAS_DIR / STATE_FILE) for s, p in layout.committed_steps(root)]
    return named_best(root, [(s, p) for s, p in states if p.is_file()], layout.parse_step_dir)
