"""The steps Lightning's `ModelCheckpoint`s name best (each one's `best_model_path`, a pointer file:
`ckpt_pointer`), kept from the daemon's retention: pinned (`contract/step/pin.py`) while the plugin lives,
and recorded in each step it stages (`contract/best_steps.py`), so retention keeps the best the newest
step records once the process ended, for a later `load_from_checkpoint(best_path)`,
`trainer.test(ckpt_path=best_path)` or resumed `fit`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from stagerd.contract import best_steps
from stagerd.contract.step.pin import StepPin
from stagerd.errors import LoadError
from stagerd.integrations.ckpt_pointer import pointed


class CheckpointBests:
    """The best steps under `root` of one plugin's trainer: its pins, and the record each step keeps."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._pins: dict[tuple[Path, int], StepPin] = {}

    def pin(self, paths: list[Any]) -> None:
        """Hold the steps these checkpoint paths point at (each pointer file read again: a fixed file name
        is rewritten for each new best), and let a step that is no longer one of them go."""
        best: dict[tuple[Path, int], StepPin] = {}
        for path in paths:
            located = _located(path)
            if located is not None:
                best[located] = self._pins.get(located) or StepPin(*located).hold()
        for key, pin in self._pins.items():
            if key not in best:
                pin.release()
        self._pins = best

    def release(self) -> None:
        for pin in self._pins.values():
            pin.release()
        self._pins = {}

    def record(self, trainer: Any, target: Path, step: int) -> dict[str, bytes]:
        """The extras that record, in step `step` saved at `target`, the steps of this ROOT each of
        `trainer`'s `ModelCheckpoint`s names best (none outside a Trainer). A best at `target` is `step`:
        ModelCheckpoint names its new best before it saves it, and the pointer there is written after."""
        if trainer is None:
            return {}
        root, here = self.root.resolve(), target.absolute()
        steps = set()
        for c in trainer.checkpoint_callbacks:
            path = getattr(c, "best_model_path", None)
            if isinstance(path, str) and path and Path(path).absolute() == here:
                steps.add(step)
            elif (located := _located(path)) is not None and located[0] == root:
                steps.add(located[1])
        return {best_steps.NAME: best_steps.encode(steps)}


def _located(path: Any) -> tuple[Path, int] | None:
    """(ROOT, step) a `best_model_path` points at; None for no pointer file."""
    try:
        return pointed(Path(path)) if isinstance(path, str) and path else None
    except LoadError:
        return None
