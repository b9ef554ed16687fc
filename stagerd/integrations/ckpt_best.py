"""The steps Lightning's `ModelCheckpoint`s keep as their best (each one's `best_model_path` and, with a
`save_top_k` of k > 0, its top k, `best_k_models`: pointer files, `ckpt_pointer`), kept from the daemon's
retention: pinned (`contract/step/pin.py`) while the plugin lives, and recorded in each step it stages
(`contract/best_steps.py`), so retention keeps those the newest step records once the process ended, for a
later `load_from_checkpoint(best_path)`, `trainer.test(ckpt_path=best_path)`, a load of each of
`best_k_models` or a resumed `fit`. `save_top_k=-1` asks Lightning to keep every checkpoint: its best alone is
pinned, the rest left to `--keep-last`, as a pin on every step would keep them all.
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
            if located is not None and located not in best:  # named twice: held once, so released too
                best[located] = self._pins.get(located) or StepPin(*located).hold()
        for key, pin in self._pins.items():
            if key not in best:
                pin.release()
        self._pins = best

    def release(self) -> None:
        for pin in self._pins.values():
            pin.release()
        self._pins = {}

    def pin_recorded(self, trainer: Any, states: Any) -> None:
        """Hold the steps the `ModelCheckpoint` states of a checkpoint being resumed from name (its
        "callbacks" entry), before Lightning restores them: each state's top k where the trainer's callback
        of that state key keeps a finite top k, else its best."""
        live = {getattr(c, "state_key", None): c for c in trainer.checkpoint_callbacks}
        paths: list[Any] = []
        for key, state in states.items() if isinstance(states, dict) else ():
            if isinstance(state, dict):
                top_k = _top_k(live.get(key))
                paths += _kept(state.get("best_model_path"), state.get("best_k_models"), top_k)
        self.pin(paths)

    def record(self, trainer: Any, target: Path, step: int) -> dict[str, bytes]:
        """The extras that record, in step `step` saved at `target`, the steps of this ROOT each of
        `trainer`'s `ModelCheckpoint`s keeps best (none outside a Trainer). A best at `target` is `step`:
        ModelCheckpoint names its new best (and top k) before it saves it, and the pointer there is
        written after."""
        if trainer is None:
            return {}
        root, here = self.root.resolve(), target.absolute()
        steps = set()
        for path in callback_paths(trainer):
            if isinstance(path, str) and path and Path(path).absolute() == here:
                steps.add(step)
            elif (located := _located(path)) is not None and located[0] == root:
                steps.add(located[1])
        return {best_steps.NAME: best_steps.encode(steps)}


def callback_paths(trainer: Any) -> list[Any]:
    """The checkpoint paths each of `trainer`'s `ModelCheckpoint`s keeps as its best now."""
    paths: list[Any] = []
    for c in trainer.checkpoint_callbacks:
        paths += _kept(getattr(c, "best_model_path", None), getattr(c, "best_k_models", None), _top_k(c))
    return paths


def _kept(best: Any, top: Any, top_k: int | None) -> list[Any]:
    """`best`, and the paths of `top` (a `best_k_models`) where `top_k` is a finite k."""
    return [best, *(top if isinstance(top, dict) and top_k is not None and top_k > 0 else ())]


def _top_k(callback: Any) -> int | None:
    top_k = getattr(callback, "save_top_k", None)
    return top_k if isinstance(top_k, int) else None


def _located(path: Any) -> tuple[Path, int] | None:
    """(ROOT, step) a `best_model_path` points at; None for no pointer file."""
    try:
        return pointed(Path(path)) if isinstance(path, str) and path else None
    except LoadError:
        return None
