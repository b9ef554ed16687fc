"""Which Hugging Face Trainer a `StagerdCallback` serves, and the methods it replaces on that one instance.

Callback events do not receive the Trainer, so a callback given to the constructor (`callbacks=[...]`) binds
to the Trainer that fires its first event, the `self` of a calling frame (`caller`). A callback added later
(`Trainer.add_callback`) hears no event before `train()` reads `resume_from_checkpoint`, and one taken out
(`remove_callback`, `pop_callback`) hears none at all; so those three are wrapped on the Trainer class, once
(`install`), to tell a callback it was added to or taken from a Trainer (`_added_to`, `_removed_from`), which
every other callback lacks.
"""

from __future__ import annotations

import functools
from typing import Any

from transformers import Trainer

from stagerd.ops.call_stack import calling_self


class Replaced:
    """Attributes set on one Trainer instance (shadowing its class's methods) until `undo`."""

    def __init__(self, trainer: Trainer, replacements: dict[str, Any]):
        self._trainer = trainer
        self._mine = dict(replacements)
        self._before = {n: trainer.__dict__[n] for n in replacements if n in trainer.__dict__}
        trainer.__dict__.update(replacements)

    def undo(self) -> None:
        attrs = self._trainer.__dict__
        for name, value in self._mine.items():
            if attrs.get(name) is not value:  # replaced again since, by someone else: theirs stays
                continue
            if name in self._before:
                attrs[name] = self._before[name]
            else:
                del attrs[name]


def caller() -> Trainer | None:
    """The Trainer that is `self` in the nearest calling frame."""
    return calling_self(Trainer)


def _tell(trainer: Trainer, callbacks: list[Any], hook: str) -> None:
    for cb in callbacks:
        method = getattr(cb, hook, None)
        if callable(method):
            method(trainer)


def _changing(original: Any) -> Any:
    @functools.wraps(original)
    def change(self: Trainer, callback: Any) -> Any:
        before = list(self.callback_handler.callbacks)
        out = original(self, callback)
        after = self.callback_handler.callbacks
        gone = [cb for cb in before if not any(cb is c for c in after)]
        added = [cb for cb in after if not any(cb is c for c in before)]
        _tell(self, gone, "_removed_from")
        try:
            _tell(self, added, "_added_to")
        except BaseException:
            for cb in added:  # refused: not left in the Trainer's callbacks unbound
                after.remove(cb)
            raise
        return out

    change.__stagerd_wrapped__ = True  # type: ignore[attr-defined]
    return change


def install() -> None:
    """Wrap `Trainer.add_callback`, `pop_callback` and `remove_callback` (once per process)."""
    for name in ("add_callback", "pop_callback", "remove_callback"):
        original = getattr(Trainer, name)
        if not getattr(original, "__stagerd_wrapped__", False):
            setattr(Trainer, name, _changing(original))
