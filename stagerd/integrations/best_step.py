"""The Trainer's best checkpoint (`load_best_model_at_end`) as a step under ROOT, pinned against the
daemon's retention until a better one is named or the training ends (after which the daemon keeps the one
the newest step's `trainer_state.json` names)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from stagerd.contract import layout
from stagerd.contract.step.pin import StepPin
from stagerd.errors import LoadError
from stagerd.training.step_choice import choose_step

STATE_FILE = "trainer_state.json"  # the Trainer's TRAINER_STATE_NAME


class BestStep:
    """Names the best step ROOT/step-N in the Trainer's state and holds its pin."""

    def __init__(self, root: Path):
        self.root = root
        self._pin: StepPin | None = None
        self.skipped: set[int] = set()  # this training's saves of steps ROOT held already: another run's

    def unloadable(self, step: int, committed: Callable[[], list[list[int]]]) -> tuple[str, str] | None:
        """Why the best step cannot be loaded at the end, and what to do; None when it can. `committed`:
        each rank's committed steps (collective; `skipped` is alike on every rank)."""
        if step in self.skipped:  # the weights there are not this run's best
            return (f"ROOT held step {step} already, another run's, so this run's was not saved",
                    "give a run that goes over steps already staged (a second train(), a rolled-back "
                    "resume) a ROOT of its own")  # fmt: skip
        try:
            choose_step(committed(), step, self.root)
        except LoadError as e:
            return (e.message, "the daemon's --keep-last keeps the best step the newest step names, "
                    "but not against a delete by hand or a newer step naming another; if published, "
                    f"`stagerd restore URL DIR --export --step {step}` fetches it")  # fmt: skip
        return None

    def path(self, step: int) -> Path:
        return self.root.absolute() / layout.step_dir_name(step)

    def named_in(self, trainer: Any, scratch: Path) -> None:
        """The Trainer names the best checkpoint after the folder it saved in when this step is the best:
        here one in `scratch`, gone after the save. It is this step's directory under ROOT instead, in
        the state and in the `trainer_state.json` the step keeps (a resumed run then knows it)."""
        best = trainer.state.best_model_checkpoint
        if best is None or Path(best).parent != scratch:
            return
        trainer.state.best_model_checkpoint = str(self.path(trainer.state.global_step))
        self.hold(trainer.state.global_step)
        written = scratch / Path(best).name / STATE_FILE
        if written.is_file():
            trainer.state.save_to_json(str(written))

    def of_resumed(self, trainer: Any, resumed: int) -> None:
        """The best step a resumed run recorded is this ROOT's step of that number: the recorded path may
        be another ROOT's (moved or copied; the Trainer's own loader would find no weights there), or
        dropped by the Trainer as no directory (the step deleted; it would end with the last weights).
        Loaded at the end if it is here, a `LoadError` if not."""
        recorded = trainer.state.best_model_checkpoint
        if recorded is None:
            state = self.path(resumed) / layout.EXTRAS_DIR / STATE_FILE
            recorded = json.loads(state.read_text()).get("best_model_checkpoint")
        step = layout.parse_step_dir(Path(recorded).name) if isinstance(recorded, str) else None
        if step is not None:  # the Trainer's own checkpoints are `checkpoint-N`
            trainer.state.best_model_checkpoint = str(self.path(step))
            self.hold(step)

    def hold(self, step: int) -> None:
        """Hold the best step against the daemon's retention, and let the previous best go."""
        pin = StepPin(self.root, step).hold()
        self.release()
        self._pin = pin

    def release(self) -> None:
        if self._pin is not None:
            self._pin.release()
            self._pin = None
