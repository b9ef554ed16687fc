"""The steps a trainer names its best, which retention keeps as pinned steps, also between a training's
end and its resume, when no trainer holds a pin: the Hugging Face Trainer's (`best_model_checkpoint` in
the newest `trainer_state.json`, which `load_best_model_at_end` reads back when the training ends) and
Lightning's (each `ModelCheckpoint`'s `best_model_path`, which the newest `extras/stagerd.best.json`
records as steps: `contract/best_steps.py`). Read in the io thread."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path

from stagerd.contract import best_steps, layout
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
    """Steps the Stager's integrations saved: the Trainer callback's (`step-N/extras/trainer_state.json`,
    which records the best as `ROOT/step-M`) and Lightning's plugin's (`step-N/extras/stagerd.best.json`)."""
    committed = layout.committed_steps(root)
    states = [(s, p / layout.EXTRAS_DIR / STATE_FILE) for s, p in committed]
    named = named_best(root, [(s, p) for s, p in states if p.is_file()], layout.parse_step_dir)
    return named | recorded_best(root, committed)


def recorded_best(root: Path, committed: list[tuple[int, Path]]) -> set[int]:
    """The steps the newest readable `extras/stagerd.best.json` of the `committed` steps names, of those
    still under `root`."""
    for _, path in reversed(committed):
        record = path / layout.EXTRAS_DIR / best_steps.NAME
        steps = best_steps.read(record) if record.is_file() else None
        if steps is not None:
            return {s for s in steps if (root / layout.step_dir_name(s)).is_dir()}
    return set()
