"""The Trainer's checkpoint writers, replaced on the instance for the duration of one `_save_checkpoint`:
they note what was asked for in a `Captured` (and take the RNG states at the moment the Trainer would),
and the small files the Trainer still writes itself (`trainer_state.json`) land in a scratch folder, for
`StagerdCallback` to save as extras."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch.distributed as dist
from transformers import Trainer

from stagerd.integrations import rng, trainer_bind
from stagerd.integrations.hf_trainer import Captured


@contextlib.contextmanager
def captured(trainer: Trainer, into: Captured, scratch: Path) -> Iterator[None]:
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0

    def save_model(output_dir: Any = None, _internal_call: bool = False) -> None:
        Path(output_dir).mkdir(parents=True, exist_ok=True)  # where trainer_state.json goes next

    def save_rng(output_dir: Any) -> None:
        into.rng = rng.capture(rank)

    replaced: dict[str, Any] = {
        "save_model": save_model,
        "_get_output_dir": lambda trial=None: str(scratch),
        "_save_optimizer_and_scheduler": lambda output_dir: setattr(into, "optimizer", True),
        "_save_scaler": lambda output_dir: setattr(into, "scaler", True),
        "_save_rng_state": save_rng,
        "_push_from_checkpoint": lambda output_dir: setattr(into, "pushed", True),
    }
    writers = trainer_bind.Replaced(trainer, replaced)
    try:
        yield
    finally:
        writers.undo()
