"""The daemon yields the disk to saves being written on its node.

A trainer's save is on the training's critical path; the daemon's export and a `file://` publish are not,
and they compete for the same disk. So while some step directory in ROOT is being written (no commit
marker, a file under its staged parts changed moments ago), their worker threads pause between moves or
chunks, for at most `yield_seconds` in total per export or publish, so a save that never ends cannot starve
the daemon. Nothing of the Stager's protocol is needed: mtimes alone tell a save in flight.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path

from stagerd.contract import layout
from stagerd.daemon.state import DaemonState, log
from stagerd.errors import ConfigError
from stagerd.sinks.urls import SinkKind, parse_sink_url

# mtimes change on write, not on fsync: a writer flushing a multi-GB file before its marker makes no mtime
# update for a second or two. 3 s covers that flush, and a save that stalled or died counts as over 3 s
# after its last write.
WRITE_WINDOW_SECONDS = 3.0
CACHE_SECONDS = 0.1  # every worker thread asks after each move or chunk: one scan answers them all
SLICE_SECONDS = 0.05
MAX_ENTRIES = 256  # per step directory: a Stager save has a few files per rank; a huge tree is not walked
_PARTS = frozenset((layout.MODEL_DIR, layout.OPTIM_DIR, layout.EXTRAS_DIR))
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def written_within(step_dir: Path, lo: float, hi: float, max_entries: int = MAX_ENTRIES) -> bool:
    """Whether an entry under the step's staged parts has an mtime in [lo, hi]. Links are never followed;
    a directory that vanished or cannot be read counts as not written."""
    try:
        top = os.open(step_dir, _DIR_FLAGS)
    except OSError:
        return False
    pending, seen = [top], 0
    try:
        while pending:
            fd = pending.pop()
            try:
                with os.scandir(fd) as it:
                    for e in it:
                        if fd == top and e.name not in _PARTS:
                            continue
                        seen += 1
                        if seen > max_entries:
                            return False
                        st = e.stat(follow_symlinks=False)
                        if lo <= st.st_mtime <= hi:
                            return True
                        if stat.S_ISDIR(st.st_mode):
                            pending.append(os.open(e.name, _DIR_FLAGS, dir_fd=fd))
            except OSError:
                continue  # gone mid-scan, or replaced by a link: nothing being written here
            finally:
                os.close(fd)
    finally:
        for fd in pending:
            os.close(fd)
    return False


def writing_steps(root: Path, window: float = WRITE_WINDOW_SECONDS) -> tuple[int, ...]:
    """Uncommitted step directories of ROOT written within the last `window` seconds, newest first."""
    now = time.time()
    try:
        dirs = list(layout.iter_step_dirs(root))
    except OSError:
        return ()
    # A future mtime within the window is a coarse clock; one far ahead would hold every export.
    return tuple(
        step
        for step, d in reversed(dirs)
        if not layout.is_committed(d) and written_within(d, now - window, now + window)
    )


class SavesInFlight:
    """`writing_steps` of one ROOT, answered from a scan at most `CACHE_SECONDS` old, for any thread."""

    def __init__(self, root: Path, window: float = WRITE_WINDOW_SECONDS) -> None:
        self.root, self.window = root, window
        self._lock = threading.Lock()
        self._at = -float("inf")
        self._steps: tuple[int, ...] = ()

    def writing(self, skip: int) -> int | None:
        """A step other than `skip` whose save is being written, or None."""
        with self._lock:
            if time.monotonic() - self._at >= CACHE_SECONDS:
                self._steps = writing_steps(self.root, self.window)
                self._at = time.monotonic()
            steps = self._steps
        return next((s for s in steps if s != skip), None)


class Yielder:
    """One export's or publish's pauses, called after each move or chunk by any of its threads. The budget
    is wall time during which at least one of its threads paused."""

    def __init__(
        self, saves: SavesInFlight, what: str, step: int, budget: float, stopping: Callable[[], bool]
    ) -> None:
        self.saves, self.what, self.step, self.budget, self.stopping = saves, what, step, budget, stopping
        self.on_waited: Callable[[float], None] = lambda seconds: None
        self.spent = 0.0
        self._lock = threading.Lock()
        self._paused = 0  # threads pausing now
        self._since = 0.0
        self._episodes = 0

    def _left(self) -> float:
        running = time.monotonic() - self._since if self._paused else 0.0
        return self.budget - self.spent - running

    def __call__(self) -> None:
        if self.budget <= 0 or self.stopping():
            return
        with self._lock:
            if self._left() <= 0:
                return
        busy = self.saves.writing(self.step)
        if busy is None:
            return
        self._enter(busy)
        try:
            while busy is not None and not self.stopping():
                with self._lock:
                    left = self._left()
                if left <= 0:
                    break
                time.sleep(min(SLICE_SECONDS, left))
                busy = self.saves.writing(self.step)
        finally:
            self._leave(busy)

    def _enter(self, busy: int) -> None:
        with self._lock:
            self._paused += 1
            if self._paused > 1:
                return
            self._since = time.monotonic()
            self._episodes += 1
            first = self._episodes == 1
        if first:
            log.info(
                "%s of step %d yields the disk to the save of step %d being written (at most %.0fs)",
                self.what,
                self.step,
                busy,
                self.budget,
                extra={"step": self.step, "yields_to": busy, "stage": self.what},
            )

    def _leave(self, busy: int | None) -> None:
        with self._lock:
            self._paused -= 1
            if self._paused:
                return
            waited = time.monotonic() - self._since
            self.spent += waited
            first = self._episodes == 1
            why = "its yield budget is spent" if self._left() <= 0 else "stopping"
        self.on_waited(waited)
        why = "no save is being written" if busy is None else why
        log.log(
            logging.INFO if first else logging.DEBUG,
            "%s of step %d resumes after %.2fs (%s)",
            self.what,
            self.step,
            waited,
            why,
            extra={"step": self.step, "stage": self.what, "yielded_seconds": round(waited, 3)},
        )


def yields_disk(sink: str) -> bool:
    """A `file://` sink writes the same disks; a remote sink's cost is the network, and it never yields."""
    try:
        return parse_sink_url(sink).kind is SinkKind.LOCAL
    except ConfigError:  # a redacted URL that no longer parses is not a local path
        return False


class Yielding(DaemonState):
    _saves: SavesInFlight

    def _yielder(self, what: str, step: int, sink: str | None = None) -> Yielder:
        """The pause hook of one export (`sink` None) or one publish to `sink`."""
        budget = self.settings.yield_seconds if sink is None or yields_disk(sink) else 0.0
        y = Yielder(self._saves, what, step, budget, lambda: self._stopping)
        y.on_waited = self.metrics.yield_seconds.labels(stage=what).inc
        return y
