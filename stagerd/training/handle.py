"""`SaveHandle`: one save in flight, as the caller sees it."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.api import CheckpointException

from stagerd.contract import commit_marker
from stagerd.errors import SaveError
from stagerd.training.failures import describe


@dataclass
class SaveHandle:
    """One save in flight. `result()` returns the commit marker of this rank's node, or raises SaveError."""

    step: int
    step_dir: Path
    staging: tuple[Future[Any], ...]
    committed: Future[commit_marker.CommitMarker] = field(repr=False)
    hurry: Callable[[], None] = field(default=lambda: None, repr=False)  # someone waits for the copy

    def staged(self) -> bool:
        return all(f.done() for f in self.staging)

    def wait_staged(self, timeout: float | None = None) -> None:
        """Block until the host copy is complete; the source tensors may then change."""
        deadline = None if timeout is None else time.monotonic() + timeout
        self.hurry()
        for f in self.staging:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                f.result(left)
            except TimeoutError:
                raise
            except (Exception, CheckpointException) as e:
                raise SaveError(
                    f"step {self.step}: staging the state dict failed: {describe(e)}", path=self.step_dir
                ) from e

    def done(self) -> bool:
        return self.committed.done()

    def result(self, timeout: float | None = None) -> commit_marker.CommitMarker:
        committed = self.committed
        self.hurry()
        try:
            return committed.result(timeout)
        finally:  # as Future.result does: the raised error's traceback must not lead back to the future
            del self, committed

    def exception(self, timeout: float | None = None) -> BaseException | None:
        return self.committed.exception(timeout)


def outcomes(handles: list[SaveHandle]) -> tuple[list[commit_marker.CommitMarker], list[BaseException]]:
    """Every handle's marker or error, the errors without tracebacks (see `Stager.wait`)."""
    markers: list[commit_marker.CommitMarker] = []
    errors: list[BaseException] = []
    for handle in handles:
        try:
            markers.append(handle.result())
        except Exception as e:
            # Its traceback would hold this frame, whose locals hold the handles and this list, which
            # hold the error: a cycle. wait() raises it again with a traceback of its own.
            errors.append(e.with_traceback(None))
    return markers, errors
