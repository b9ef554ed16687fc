"""What every part of the daemon shares: its settings, journal, sinks, pools, events and in-flight work.

The daemon is one object assembled from one class per job (journal gate, discovery, scheduling, tasks,
housekeeping, summary); they all read and write the fields declared here, and run blocking calls through
the pools here, so the event loop only schedules.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from stagerd.config import Settings
from stagerd.daemon.journal import Journal, LaneState, StepState
from stagerd.daemon.lock import RootLock
from stagerd.daemon.metrics import Metrics
from stagerd.daemon.retention import DiskState
from stagerd.errors import JournalError
from stagerd.sinks.base import Sink

if TYPE_CHECKING:
    from stagerd.daemon.unfinished import Unfinished
    from stagerd.sinks.fetch import RemoteStore
    from stagerd.sinks.fsspec import FsspecSink
    from stagerd.sinks.prune import Owner, Policy

log = logging.getLogger("stagerd")

T = TypeVar("T")


class DaemonState:
    """The fields the daemon's parts share (set by `Daemon.__init__` and `Daemon.run`)."""

    settings: Settings
    root: Path
    metrics: Metrics
    left_threads_running: bool
    _sinks: dict[str, Sink]
    _raw_sinks: dict[str, FsspecSink]  # raw lane key (`raw:<url>`) -> its fsspec sink (--publish-raw)
    _lane_pools: dict[str, ThreadPoolExecutor]
    _prune_stores: dict[str, tuple[RemoteStore, Policy, Owner]]  # sink url -> store, policy, whose steps
    _journal: Journal
    _jpool: ThreadPoolExecutor
    _iopool: ThreadPoolExecutor
    _trashpool: ThreadPoolExecutor
    _export_pool: ThreadPoolExecutor
    _wake: asyncio.Event
    _stop: asyncio.Event
    _housekeep: asyncio.Event
    _stopping: bool
    _background: set[asyncio.Future[None]]
    _inflight_exports: dict[int, asyncio.Task[None]]
    _inflight_publishes: dict[tuple[int, str], asyncio.Task[None]]
    _beat: float
    _disk: DiskState | None
    _health: dict[str, Any]
    _journal_failures: int
    _journal_retry_at: float
    _fatal: JournalError | None
    _root_lock: RootLock
    _odd_names: set[str]  # names like step directories that are not, warned about once each
    _unfinished: list[Unfinished]  # the saves the last scan left alone as unfinished: `--once` names them
    # the last adopt scan's folders of ROOT that give no step number but hold checkpoints, each with why
    _nested: list[str]
    _unfinished_recorded: dict[str, Any] | None  # what the journal keeps of them, for `stagerd status`
    _adopt_root: Path | None  # `--adopt`: where adopted checkpoints' exports are built; None: Stager steps
    _started: float  # when `run` began: a `--once` summary counts the steps this run published apart

    def _work_dir(self, step_dir: Path) -> Path:
        """Where a step's export is built: in the step directory, or for an adopted checkpoint (which is
        never written) in its own directory under the adopt root."""
        return step_dir if self._adopt_root is None else self._adopt_root / step_dir.name

    def _lane_keys(self) -> list[str]:
        """Every lane a step must finish to be published: one per sink, and one per raw sink."""
        return [*self._sinks, *self._raw_sinks]

    async def _j(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run a journal call on the journal thread (commits fsync; the loop must not wait on disk)."""
        return await asyncio.get_running_loop().run_in_executor(self._jpool, partial(fn, *args, **kwargs))

    async def _io(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._iopool, partial(fn, *args, **kwargs))

    async def _trash(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._trashpool, partial(fn, *args))

    def _log_step(
        self,
        step: int,
        sink: str | None,
        state: StepState | LaneState,
        *,
        error_class: str | None = None,
        note: str = "",
        level: int = logging.INFO,
        **extra: Any,
    ) -> None:
        """Log one step's (or one lane's) new state, as a line a person reads and as JSON fields."""
        where = f" on {sink}" if sink else ""
        text = f"step {step}{where}: {state}" + (f" ({note})" if note else "")
        log.log(
            level,
            text,
            extra={"step": step, "sink": sink, "state": state, "error_class": error_class, **extra},
        )
