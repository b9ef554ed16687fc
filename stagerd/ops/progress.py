"""Progress for long operations: a rich bar on a terminal, a few plain log lines everywhere else.

`progress()` yields a thread-safe `(done, total)` callback, the shape of `Sink.publish(progress=...)` and
`export_step(progress=...)`. On a TTY every concurrent `progress()` shares one live rich display (rich
allows only one), so two sinks uploading at once show two bars. Off a TTY (journald, a container log) it
logs at most one line per ~10% of the work or per ~5 s, whichever comes first, plus the final line.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.filesize import decimal

log = logging.getLogger("stagerd")

ProgressCallback = Callable[[int, int], None]

LOG_EVERY_FRACTION = 0.10
LOG_EVERY_SECONDS = 5.0

_live_lock = threading.Lock()
_live = None  # the shared rich Progress while any bar is open
_live_users = 0


def _fmt(n: int, unit: str) -> str:
    return decimal(n) if unit == "B" else f"{n:,} {unit}".rstrip()


class _LogLines:
    """The plain-text reporter: throttled log lines, safe to call from any thread."""

    def __init__(self, description: str, total: int, unit: str) -> None:
        self.description = description
        self.total = total
        self.unit = unit
        self.start = time.monotonic()
        self.last_time = self.start
        self.last_decile = 0
        self.last_done = 0
        self.finished = False
        self.calls = 0
        self.last_emitted: tuple[int, int] | None = None
        self.lock = threading.Lock()

    def __call__(self, done: int, total: int) -> None:
        with self.lock:
            self.total = total
            self.calls += 1
            if self.finished or (done <= self.last_done and done < total):
                return
            now = time.monotonic()
            decile = int(done * 10 // total) if total > 0 else 0
            due = decile > self.last_decile or now - self.last_time >= LOG_EVERY_SECONDS
            self.last_done = done
            if total > 0 and done >= total:
                self.finished = True
            elif not due:
                return
            self.last_decile, self.last_time = decile, now
            self._emit(done, now)

    def close(self) -> None:
        """The operation ended well: log its last state once, if no line showed the end yet."""
        with self.lock:
            if self.calls and not self.finished:
                self.finished = True
                if self.last_emitted != (self.last_done, self.total):
                    self._emit(self.last_done, time.monotonic())

    def _emit(self, done: int, now: float) -> None:
        self.last_emitted = (done, self.total)
        elapsed = now - self.start
        pct = 100 * done // self.total if self.total > 0 else 100  # floor: 99.7% is not done
        rate = f", {_fmt(int(done / elapsed), self.unit)}/s" if elapsed > 0.05 and done else ""
        log.info(
            "%s: %s / %s (%d%%) in %.1fs%s",
            self.description,
            _fmt(done, self.unit),
            _fmt(self.total, self.unit),
            pct,
            elapsed,
            rate,
            extra={"progress_done": done, "progress_total": self.total},
        )


def _new_live():
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        Progress,
        ProgressColumn,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )
    from rich.table import Column
    from rich.text import Text

    class Counts(ProgressColumn):
        """`1.2/3.4 GB 250 MB/s` for bytes, `3/7 steps` for anything else."""

        def render(self, task) -> Text:
            unit = task.fields.get("unit", "B")
            done, total = int(task.completed), int(task.total or 0)
            if unit != "B":
                return Text(f"{done}/{total} {unit}", style="progress.download")
            speed = f" {decimal(int(task.speed))}/s" if task.speed else ""
            return Text(f"{decimal(done)}/{decimal(total)}{speed}", style="progress.download")

    return Progress(
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        Counts(table_column=Column(no_wrap=True)),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=Console(stderr=True),
    )


@contextmanager
def _rich_bar(description: str, total: int, unit: str) -> Iterator[ProgressCallback]:
    global _live, _live_users
    with _live_lock:
        if _live is None:
            _live = _new_live()
            _live.start()
        live = _live
        _live_users += 1
        task = live.add_task(description, total=total, unit=unit)
    lock = threading.Lock()

    def update(done: int, total: int) -> None:
        with lock:
            live.update(task, completed=done, total=total)

    try:
        yield update
    finally:
        with _live_lock:
            live.refresh()
            _live_users -= 1
            if _live_users == 0:
                live.stop()
                _live = None


@contextmanager
def progress(
    description: str, total: int, *, unit: str = "B", tty: bool | None = None
) -> Iterator[ProgressCallback]:
    """Report progress of `description` over `total` units; yields a thread-safe `(done, total)` callback.

    `tty=None` decides by whether stderr is a terminal.
    """
    if tty is None:
        # while a bar shows, sys.stderr is rich's proxy, which before rich 15 says it is no terminal
        tty = _live is not None or sys.stderr.isatty()
    if tty:
        with _rich_bar(description, total, unit) as cb:
            yield cb
    else:
        lines = _LogLines(description, total, unit)
        yield lines
        lines.close()
