"""`stagerd watch`: the per-node asyncio daemon.

It finds committed steps (watchfiles events plus a periodic rescan), exports them in step order in a
worker pool, publishes each exported step on every sink in that sink's own lane (its own threads and
concurrency, so a slow store never holds up another), and applies retention. The journal records every
transition before and after the work, so a restart after any crash resumes; the export engine and the
sinks are idempotent, so resumed work neither loses nor duplicates a step.

Blocking work (exports, uploads, journal commits with fsync, scans, deletes) runs in thread pools; the
event loop only schedules.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import os
import signal
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

from rich.filesize import decimal

from stagerd.config import Settings
from stagerd.contract import layout
from stagerd.daemon.journal import (
    COMMITTED,
    EXPORTED,
    FAILED,
    PENDING,
    PUBLISHED,
    PUBLISHING,
    QUARANTINED,
    RETIRED,
    Journal,
)
from stagerd.daemon.lock import RootLock
from stagerd.daemon.metrics import Metrics, MetricsServer
from stagerd.daemon.retention import (
    DiskState,
    StepView,
    disk_state,
    empty_trash,
    move_to_trash,
    plan_retention,
)
from stagerd.errors import ConfigError, JournalError, StagerdError
from stagerd.ops import notify
from stagerd.ops.crashpoints import crash_point
from stagerd.ops.priority import lower_priority

log = logging.getLogger("stagerd")

T = TypeVar("T")

HEALTH_STALE_SECONDS = 15.0


@dataclass(frozen=True)
class Failure:
    """What to record for a failed attempt: retry at `next_try`, or quarantine."""

    error_class: str
    message: str
    quarantine: bool
    next_try: float | None


def backoff_delay(attempts: int, settings: Settings) -> float:
    """Seconds to wait after the `attempts`-th failure: doubling from `retry_base_seconds`, capped."""
    return min(settings.retry_max_seconds, settings.retry_base_seconds * 2 ** (attempts - 1))


def decide_failure(err: BaseException, attempts: int, settings: Settings, now: float) -> Failure:
    """Pure retry policy: non-retryable errors quarantine at once; others back off until attempts run out."""
    if isinstance(err, StagerdError):
        retryable, cls, msg = err.retryable, err.name, str(err)
    else:  # an unexpected exception: a bug or an unwrapped OSError; retrying is the safe default
        retryable, cls, msg = True, type(err).__name__, str(err) or repr(err)
    if not retryable or attempts >= settings.max_attempts:
        return Failure(cls, msg, True, None)
    return Failure(cls, msg, False, now + backoff_delay(attempts, settings))


class _Abandoned(Exception):
    """A journal write given up (shutdown, `--once`, or an error retrying cannot fix): the step keeps its
    last recorded state, which the next start recovers."""


@dataclass
class Summary:
    """What a `--once` run leaves behind."""

    published: list[int] = field(default_factory=list)
    unpublished: list[tuple[int, str]] = field(default_factory=list)  # (step, why)

    @property
    def ok(self) -> bool:
        return not self.unpublished


class Daemon:
    """One ROOT's daemon. `await run()` returns the process exit code."""

    def __init__(self, settings: Settings) -> None:
        if settings.root is None:
            raise ConfigError("no ROOT given: `stagerd watch ROOT --sink URL`")
        if not settings.sinks:
            raise ConfigError("no sink: pass --sink URL (or STAGERD_SINKS, or `sinks` in the config file)")
        self.settings = settings
        self.root = Path(settings.root)
        self.metrics = Metrics()
        self.left_threads_running = False  # set when shutdown abandoned work still running in a thread
        self.metrics_address: tuple[str, int] | None = None
        self._sinks: dict[str, Any] = {}
        self._lane_pools: dict[str, ThreadPoolExecutor] = {}
        self.summary: Summary | None = None
        self._background: set[asyncio.Future] = set()
        self._journal: Journal | None = None
        self._stopping = False
        self._inflight_exports: dict[int, asyncio.Task] = {}
        self._inflight_publishes: dict[tuple[int, str], asyncio.Task] = {}
        self._beat = time.monotonic()
        self._disk: DiskState | None = None
        self._health: dict[str, Any] = {"status": "starting", "pid": os.getpid()}
        self._journal_failures = 0  # consecutive failed journal calls; 0 once a write lands again
        self._journal_retry_at = 0.0  # monotonic; nothing touches the journal before this
        self._fatal: JournalError | None = None  # --once: the journal error that ends the run (exit 3)

    # -- lifecycle ---------------------------------------------------------------------------------------

    async def run(self) -> int:
        """Lock ROOT, recover, scan, then run until a signal (or, with `once`, until everything settles)."""
        if not self.root.is_dir():
            raise ConfigError("ROOT is not a directory", path=self.root)
        lock = RootLock(self.root)
        lock.acquire()
        try:
            # Niceness and the I/O class are per thread on Linux: set them before any thread exists.
            applied = lower_priority(self.settings.nice, self.settings.io_class)
            self._jpool = ThreadPoolExecutor(1, thread_name_prefix="stagerd-journal")
            self._iopool = ThreadPoolExecutor(1, thread_name_prefix="stagerd-io")
            # Deleting a retired step can take seconds: its own thread, so scans and checks never wait on it.
            self._trashpool = ThreadPoolExecutor(1, thread_name_prefix="stagerd-trash")
            self._export_pool = ThreadPoolExecutor(
                self.settings.export_workers, thread_name_prefix="stagerd-export"
            )
            try:
                return await self._run(applied)
            finally:
                for pool in (self._export_pool, self._iopool, self._trashpool, *self._lane_pools.values()):
                    pool.shutdown(wait=not self.left_threads_running, cancel_futures=True)
                self._jpool.shutdown(wait=True)
        finally:
            lock.release()

    async def _run(self, applied: dict[str, object]) -> int:
        from stagerd.sinks import open_sink

        loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        self._stop = asyncio.Event()
        self._housekeep = asyncio.Event()
        self._journal = await self._io(Journal.open, self.root)
        server = None
        try:
            for url in self.settings.sinks:
                sink = await self._io(open_sink, url)
                self._sinks[sink.url] = sink
                self._lane_pools[sink.url] = ThreadPoolExecutor(
                    self.settings.publish_workers, thread_name_prefix="stagerd-publish"
                )
            log.info(
                "stagerd watching %s",
                self.root,
                extra={"root": str(self.root), "sinks": list(self._sinks), "pid": os.getpid(), **applied},
            )
            # Import the export engine now, not inside the first step's pickup latency.
            await asyncio.get_running_loop().run_in_executor(
                self._export_pool, importlib.import_module, "stagerd.engine.export"
            )
            removed = await self._trash(empty_trash, self.root)
            if removed:
                log.info("removed %d leftover(s) of an interrupted retention from the trash", removed)
            await self._recover()
            await self._scan()
            await self._j(
                self._journal.set_meta,
                pid=os.getpid(),
                started=time.time(),
                sinks=list(self._sinks),
                low_disk_free_percent=self.settings.low_disk_free_percent,
                low_disk_free_bytes=self.settings.low_disk_free_bytes,
                keep_last=self.settings.keep_last,
            )
            await self._check_disk()
            await self._refresh()
            if self.settings.metrics_port:
                host, port = self.settings.metrics_host, self.settings.metrics_port
                try:
                    server = MetricsServer(self.metrics, host, port, self._healthz)
                except OSError as e:
                    raise ConfigError(
                        f"cannot serve metrics on {host}:{port}: {e.strerror or e}",
                        hint="pick a free --metrics-port, or 0 to turn the metrics server off",
                    ) from None
                server.start()
                self.metrics_address = (server.host, server.port)
                log.info("metrics on http://%s:%d/metrics", server.host, server.port)
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self._on_signal, sig)
            notify.notify_ready(f"watching {self.root}")
            self._health["status"] = "ok"
            tasks = [
                asyncio.create_task(self._ticker(), name="ticker"),
                asyncio.create_task(self._housekeeping(), name="housekeeping"),
            ]
            if not self.settings.once:
                tasks.append(asyncio.create_task(self._rescanner(), name="rescan"))
                if self.settings.watch:
                    tasks.append(asyncio.create_task(self._watcher(), name="watch"))
            try:
                await self._schedule()
            finally:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
            await self._drain()
            if self._fatal is not None:
                raise self._fatal
            if self.settings.once and not self._stopping:
                await self._retain()
                self.summary = await self._summary()
                return self._report(self.summary)
            log.info("stagerd stopped", extra={"state": "stopped"})
            return 0
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)
            if server is not None:
                server.close()
            for sink in self._sinks.values():
                with contextlib.suppress(Exception):
                    await self._io(sink.close)
            await self._j(self._journal.close)

    def _on_signal(self, sig: int) -> None:
        if self._stopping:
            log.warning("second %s: abandoning in-flight work now", signal.Signals(sig).name)
            self.settings = self.settings.model_copy(update={"grace_seconds": 0.0})
            self._stop.set()
            return
        log.info(
            "%s: no new work; draining (grace %.0fs)",
            signal.Signals(sig).name,
            self.settings.grace_seconds,
            extra={"state": "stopping"},
        )
        self._stopping = True
        self._health["status"] = "stopping"
        notify.notify_stopping(f"draining, grace {self.settings.grace_seconds:.0f}s")
        notify.notify_extend_timeout(self.settings.grace_seconds + 10)
        self._stop.set()
        self._wake.set()

    async def _drain(self) -> None:
        """Wait for in-flight work up to the grace period; abandon (and journal) what is still running."""
        inflight = {**{(s, None): t for s, t in self._inflight_exports.items()}, **self._inflight_publishes}
        if not inflight:
            return
        if self._stopping:
            log.info("waiting for %d in-flight job(s)", len(inflight))
            deadline = time.monotonic() + self.settings.grace_seconds
            pending = set(inflight.values())
            while pending and time.monotonic() < deadline and self.settings.grace_seconds > 0:
                _, pending = await asyncio.wait(
                    pending, timeout=min(0.5, max(0.0, deadline - time.monotonic()))
                )
        else:
            await asyncio.gather(*inflight.values(), return_exceptions=True)
        for (step, sink), task in inflight.items():
            if task.done():
                continue
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
            try:
                await self._j(self._journal.abandon, step, sink, "abandoned at shutdown")
            except JournalError:
                continue  # it finished and recorded itself while we were cancelling it
            self.left_threads_running = True
            self._transition(step, sink, COMMITTED if sink is None else PENDING, note="abandoned at shutdown")

    # -- helpers -----------------------------------------------------------------------------------------

    async def _j(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run a journal call on the journal thread (commits fsync; the loop must not wait on disk)."""
        return await asyncio.get_running_loop().run_in_executor(self._jpool, partial(fn, *args, **kwargs))

    def _journal_backing_off(self) -> bool:
        return time.monotonic() < self._journal_retry_at

    def _journal_down(self, err: JournalError, doing: str) -> None:
        """Count a failed journal call; the first failure of a backoff period logs it and starts the next.

        With `--once` the run ends instead (exit 3, naming the journal); the next start recovers.
        """
        self.metrics.failures.labels(stage="journal", error_class=err.name).inc()
        if self._journal_backing_off():
            return  # a call already queued when the backoff began: counted, not logged again
        self._journal_failures += 1
        delay = backoff_delay(self._journal_failures, self.settings)
        self._journal_retry_at = time.monotonic() + delay
        then = "stopping" if self.settings.once else f"journal paused for {delay:g}s"
        log.error(
            "journal: cannot %s: %s: %s; %s (what to do: %s)",
            doing,
            err.name,
            err,
            then,
            err.hint,
            extra={"error_class": err.name, "journal_failures": self._journal_failures, "hint": err.hint},
        )
        if self.settings.once:
            self._fatal = self._fatal or err
            self._stop.set()
            return
        if self._health["status"] == "ok":
            self._health["status"] = "journal unavailable"
        self._health["journal_error"] = f"{err.name}: {err}"
        notify.notify_status(f"JOURNAL UNAVAILABLE ({err.name}); retrying in {delay:g}s")

    def _journal_up(self) -> None:
        """A journal write landed: end the backoff and report healthy again."""
        if self._journal_failures == 0:
            return
        log.info("journal: writable again after %d failed attempt(s)", self._journal_failures)
        self._journal_failures = 0
        self._journal_retry_at = 0.0
        self._health.pop("journal_error", None)
        if self._health["status"] == "journal unavailable":
            self._health["status"] = "ok"

    async def _journal_pause(self) -> None:
        """Sleep out the journal backoff (a no-op outside one); shutdown cuts it short."""
        delay = self._journal_retry_at - time.monotonic()
        if delay > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), timeout=delay)

    async def _record(self, doing: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """A journal write that records work already done: retried after each backoff until it lands.

        Raises `_Abandoned` at shutdown, with `--once`, or on an error retrying cannot fix.
        """
        while True:
            await self._journal_pause()
            try:
                out = await self._j(fn, *args, **kwargs)
            except JournalError as e:
                self._journal_down(e, doing)
                if self.settings.once:
                    raise _Abandoned(doing) from e  # the run ends naming the journal
                if self._stopping or not e.retryable:
                    log.error("could not %s (%s: %s); the next start recovers it", doing, e.name, e)
                    raise _Abandoned(doing) from e
                continue
            self._journal_up()
            return out

    async def _try_refresh(self) -> None:
        """`_refresh`, unless stopping or the journal is backing off; a journal error starts a backoff."""
        if self._stopping or self._journal_backing_off():
            return
        try:
            await self._refresh()
        except JournalError as e:
            self._journal_down(e, "read the journal")

    async def _io(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._iopool, partial(fn, *args, **kwargs))

    async def _trash(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._trashpool, partial(fn, *args))

    def _transition(
        self,
        step: int,
        sink: str | None,
        state: str,
        *,
        error_class: str | None = None,
        note: str = "",
        level: int = logging.INFO,
        **extra: Any,
    ) -> None:
        where = f" on {sink}" if sink else ""
        text = f"step {step}{where}: {state}" + (f" ({note})" if note else "")
        log.log(
            level,
            text,
            extra={"step": step, "sink": sink, "state": state, "error_class": error_class, **extra},
        )

    def _test_pause(self, where: str, step: int) -> None:
        """TEST ONLY (`test_pause_at`): park the worker mid-way so a test can kill the daemon there."""
        if self.settings.test_pause_at == where:
            log.warning("test pause at %s of step %d", where, step, extra={"test_pause": where, "step": step})
            time.sleep(self.settings.test_pause_seconds)

    # -- finding steps -----------------------------------------------------------------------------------

    async def _scan(self) -> int:
        """Journal every committed step under ROOT that the journal does not know yet."""
        known = await self._j(self._journal.known_steps)

        def find() -> list[tuple[int, Path, float]]:
            out = []
            for step, path in layout.iter_step_dirs(self.root):
                if step in known:
                    continue
                try:
                    mtime = (path / layout.MARKER_NAME).stat().st_mtime
                except FileNotFoundError:
                    continue  # not committed: never touched
                out.append((step, path, mtime))
            return out

        added = 0
        for step, path, mtime in await self._io(find):
            if await self._j(self._journal.add_step, step, path, mtime):
                added += 1
                self._transition(step, None, COMMITTED, marker_age=round(time.time() - mtime, 3))
        if added:
            self._wake.set()
            self._housekeep.set()
        return added

    async def _watcher(self) -> None:
        """inotify (watchfiles) on ROOT: a new marker or step directory triggers a scan."""
        import watchfiles

        def relevant(_change: watchfiles.Change, path: str) -> bool:
            name = os.path.basename(path)
            return name == layout.MARKER_NAME or layout.parse_step_dir(name) is not None

        try:
            async for changes in watchfiles.awatch(
                self.root,
                watch_filter=relevant,
                debounce=self.settings.watch_debounce_ms,
                step=min(50, self.settings.watch_debounce_ms),
                stop_event=self._stop,
                ignore_permission_denied=True,
            ):
                await self._scan_safely()
                if any(os.path.basename(p) != layout.MARKER_NAME for _, p in changes):
                    # A marker written right after its directory can beat the new directory's watch.
                    asyncio.get_running_loop().call_later(1.0, self._rescan_soon)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # inotify limits, an unsupported filesystem: the rescan still finds steps
            log.warning("filesystem events unavailable (%s); relying on the %.0fs rescan", e, self._rescan_s)

    async def _scan_safely(self) -> None:
        """`_scan`, logging its failure; skipped while the journal backs off (the rescan after finds it)."""
        if self._journal_backing_off():
            return
        try:
            await self._scan()
        except JournalError as e:
            self._journal_down(e, "record new steps")
        except (OSError, StagerdError) as e:
            log.warning("rescan of %s failed: %s", self.root, e)

    def _rescan_soon(self) -> None:
        if not self._stopping:
            task = asyncio.ensure_future(self._scan_safely())
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    @property
    def _rescan_s(self) -> float:
        return self.settings.rescan_seconds

    async def _rescanner(self) -> None:
        while not self._stopping:
            await asyncio.sleep(self._rescan_s)
            await self._scan_safely()

    async def _recover(self) -> None:
        """Resume after a crash: put in-flight work back, lanes for new sinks, and vanished steps aside."""
        for r in await self._j(self._journal.recover):
            self._transition(
                r.step, r.sink, COMMITTED if r.sink is None else PENDING, note="resumed after a crash"
            )
            if r.attempts >= self.settings.max_attempts:
                what = "export" if r.sink is None else "publish"
                msg = f"the daemon died during {r.attempts} {what} attempts of this step"
                if r.sink is None:
                    await self._j(self._journal.quarantine_step, r.step, "CrashLoop", msg)
                else:
                    await self._j(self._journal.quarantine_lane, r.step, r.sink, "CrashLoop", msg)
                self._transition(r.step, r.sink, QUARANTINED, error_class="CrashLoop", note=msg)
        for step, sink in await self._j(self._journal.ensure_lanes, list(self._sinks)):
            self._transition(step, sink, PENDING, note="new sink")
        for row in await self._j(self._journal.steps, include_retired=False):
            if row.state == QUARANTINED or await self._io(Path(row.path).is_dir):
                continue
            if row.state == PUBLISHED:  # retention moved it to the trash, then the daemon died
                await self._j(self._journal.retire, row.step, "staged data already removed")
                self._transition(row.step, None, RETIRED, note="removed before the last restart")
            else:
                msg = f"the step directory {row.path} disappeared before the step was published"
                await self._j(self._journal.quarantine_step, row.step, "MissingStep", msg)
                self._transition(
                    row.step, None, QUARANTINED, error_class="MissingStep", note=msg, level=logging.ERROR
                )

    # -- the pipeline ------------------------------------------------------------------------------------

    async def _schedule(self) -> None:
        """Start exports and publishes as slots free up; with `once`, return when nothing is left to do.

        While the journal backs off nothing new starts: a full journal disk costs one log line per backoff.
        """
        while not self._stop.is_set():
            await self._journal_pause()
            if self._stop.is_set():
                return
            self._wake.clear()
            try:
                if await self._schedule_pass():
                    return
            except JournalError as e:
                self._journal_down(e, "look for work")

    async def _schedule_pass(self) -> bool:
        """Start what has a free slot, then wait for a wake-up or the next retry; True when `once` is done."""
        now = time.time()
        while len(self._inflight_exports) < self.settings.export_workers and not self._journal_backing_off():
            row = await self._j(self._journal.next_export, now, self._inflight_exports)
            if row is None:
                break
            self._inflight_exports[row.step] = asyncio.create_task(self._export(row.step, Path(row.path)))
        for sink in self._sinks:
            busy = [s for (s, k) in self._inflight_publishes if k == sink]
            while len(busy) < self.settings.publish_workers and not self._journal_backing_off():
                lane = await self._j(self._journal.next_publish, sink, now, busy)
                if lane is None:
                    break
                busy.append(lane.step)
                self._inflight_publishes[(lane.step, sink)] = asyncio.create_task(
                    self._publish(lane.step, sink)
                )
        idle = not self._inflight_exports and not self._inflight_publishes
        if self.settings.once and idle and await self._settled():
            return True
        timeout = 1.0
        next_try = await self._j(self._journal.next_retry_time)
        if next_try is not None:
            timeout = min(timeout, max(0.0, next_try - time.time()))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), timeout=timeout)
        return False

    async def _settled(self) -> bool:
        """Nothing runs and nothing waits (not even a retry): every live step is published or quarantined."""
        rows = await self._j(self._journal.steps, include_retired=False)
        if any(r.state in (COMMITTED, FAILED) for r in rows):
            return False
        lanes = await self._j(self._journal.lanes)
        live = {r.step for r in rows if r.state == EXPORTED}
        return not any(ln.step in live and ln.state in (PENDING, PUBLISHING, FAILED) for ln in lanes)

    async def _export(self, step: int, step_dir: Path) -> None:
        """One step's export task: begin, export, record; a journal error ends it quietly."""
        try:
            await self._export_step(step, step_dir)
        except JournalError as e:  # reading the step or beginning its export: nothing was started
            self._journal_down(e, f"start the export of step {step}")
        except _Abandoned:
            pass  # logged where it was given up
        finally:
            self._inflight_exports.pop(step, None)
            await self._try_refresh()
            self._wake.set()

    async def _export_step(self, step: int, step_dir: Path) -> None:
        row = await self._j(self._journal.step, step)
        attempt = await self._j(self._journal.begin_export, step)
        self._journal_up()
        if attempt == 1 and row is not None:
            self.metrics.pickup_seconds.observe(max(0.0, time.time() - row.marker_mtime))
        self._transition(step, None, "exporting", attempt=attempt)
        await self._try_refresh()
        t0 = time.monotonic()
        try:
            result = await asyncio.get_running_loop().run_in_executor(
                self._export_pool, self._run_export, step, step_dir
            )
        except asyncio.CancelledError:
            raise
        except Exception as e:
            await self._work_failed(step, None, attempt, e)
            return
        seconds = time.monotonic() - t0
        export_bytes = sum(size for _, size in result.files)
        # The export is on disk: recording it is retried with this result, never redone.
        await self._record(
            f"record the export of step {step}",
            self._journal.finish_export,
            step,
            list(self._sinks),
            seconds=result.seconds if result.skipped else seconds,
            export_bytes=export_bytes,
            tensor_bytes=result.tensor_bytes,
            files=len(result.files),
            skipped=result.skipped,
        )
        if not result.skipped:
            self.metrics.exported_bytes.inc(export_bytes)
            self.metrics.export_seconds.observe(seconds)
        self._transition(
            step,
            None,
            EXPORTED,
            note=f"{decimal(export_bytes)} in {seconds:.2f}s"
            + (", already complete" if result.skipped else ""),
            seconds=round(seconds, 3),
            bytes=export_bytes,
            skipped=result.skipped,
        )

    def _run_export(self, step: int, step_dir: Path) -> Any:
        """Worker thread: the export engine, with progress and the test pause hook."""
        from stagerd.engine.export import export_step
        from stagerd.ops.progress import progress

        with contextlib.ExitStack() as stack:
            bar: Callable[[int, int], None] | None = None

            def report(done: int, total: int) -> None:
                nonlocal bar
                crash_point("export.move")
                if bar is None:
                    bar = stack.enter_context(progress(f"export step {step}", total))
                    self._test_pause("export", step)
                bar(done, total)

            s = self.settings
            return export_step(
                step_dir,
                dtype=s.dtype,
                keep_dtype=s.keep_dtype,
                max_shard_size=int(s.max_shard_size),
                threads=s.export_threads,
                progress=report,
            )

    async def _work_failed(self, step: int, sink: str | None, attempt: int, err: BaseException) -> None:
        """Record and log a failed export (`sink` None) or publish: retried later, or quarantined."""
        f = decide_failure(err, attempt, self.settings, time.time())
        if sink is None:
            stage, what = "export", f"step {step}"
            fail = partial(self._journal.fail_export, step)
        else:
            stage, what = "publish", f"step {step} on {sink}"
            fail = partial(self._journal.fail_publish, step, sink)
        state = await self._record(
            f"record the failed {stage} of {what}",
            fail,
            f.error_class,
            f.message,
            next_try=f.next_try,
            quarantine=f.quarantine,
        )
        self.metrics.failures.labels(stage=stage, error_class=f.error_class).inc()
        self._log_failure(step, sink, state, f, attempt, err)

    def _log_failure(
        self, step: int, sink: str | None, state: str, f: Failure, attempt: int, err: BaseException
    ) -> None:
        if f.quarantine:
            note = f"{f.error_class}: {f.message}; kept on disk, will not be retried"
        else:
            note = f"{f.error_class}: {f.message}; retry {attempt + 1} in {f.next_try - time.time():.0f}s"
        self._transition(
            step,
            sink,
            state,
            error_class=f.error_class,
            note=note,
            level=logging.ERROR if f.quarantine else logging.WARNING,
            attempt=attempt,
            hint=getattr(err, "hint", None),
        )
        if not isinstance(err, StagerdError):
            log.debug("unexpected error", exc_info=err)

    async def _publish(self, step: int, sink: str) -> None:
        """One (step, sink) publish task: begin, publish, record; a journal error ends it quietly."""
        try:
            await self._publish_step(step, sink)
        except JournalError as e:  # reading the step, sending it back, or beginning: nothing was published
            self._journal_down(e, f"start the publish of step {step} on {sink}")
        except _Abandoned:
            pass  # logged where it was given up
        finally:
            self._inflight_publishes.pop((step, sink), None)
            await self._try_refresh()
            self._wake.set()

    async def _publish_step(self, step: int, sink: str) -> None:
        row = await self._j(self._journal.step, step)
        assert row is not None
        export_dir = Path(row.path) / layout.EXPORT_DIR
        if not await self._io(export_dir.is_dir):
            await self._export_vanished(step, Path(row.path))
            return
        attempt = await self._j(self._journal.begin_publish, step, sink)
        self._journal_up()
        self._transition(step, sink, PUBLISHING, attempt=attempt)
        await self._try_refresh()
        try:
            result = await asyncio.get_running_loop().run_in_executor(
                self._lane_pools[sink], self._run_publish, step, sink, export_dir, Path(row.path)
            )
        except asyncio.CancelledError:
            raise
        except Exception as e:
            await self._work_failed(step, sink, attempt, e)
            return
        crash_point("publish.done")
        # The sink holds the step: recording it is retried with this result, never published again.
        done = await self._record(
            f"record the publish of step {step} on {sink}",
            self._journal.finish_publish,
            step,
            sink,
            sinks=list(self._sinks),
            seconds=result.seconds,
            bytes_total=result.bytes_total,
            bytes_uploaded=result.bytes_uploaded,
            location=result.location,
            skipped=result.skipped,
        )
        self.metrics.published_bytes.labels(sink=sink).inc(result.bytes_uploaded)
        self.metrics.publish_seconds.labels(sink=sink).observe(result.seconds)
        self._transition(
            step,
            sink,
            PUBLISHED,
            note=f"{result.location}, {decimal(result.bytes_uploaded)} uploaded "
            f"in {result.seconds:.2f}s" + (", already there" if result.skipped else ""),
            seconds=round(result.seconds, 3),
            bytes=result.bytes_uploaded,
            skipped=result.skipped,
        )
        if done:
            total = time.time() - row.marker_mtime
            self._transition(step, None, PUBLISHED, note=f"on every sink, {total:.2f}s after its marker")
            self._housekeep.set()

    async def _export_vanished(self, step: int, step_dir: Path) -> None:
        """export/ is gone before every sink had it: export again, or quarantine if the step is gone too."""
        if not await self._io(step_dir.is_dir):
            msg = f"the step directory {step_dir} disappeared before the step was published"
            await self._j(self._journal.quarantine_step, step, "MissingStep", msg)
            self._transition(step, None, QUARANTINED, error_class="MissingStep", note=msg)
            return
        try:
            await self._j(self._journal.reexport, step, "export/ disappeared; exporting again")
        except JournalError:
            row = await self._j(self._journal.step, step)
            if row is not None and row.state in (EXPORTED, PUBLISHED):
                raise  # not another lane sending it back first: a real journal failure
            return
        self._transition(step, None, COMMITTED, note="export/ disappeared; exporting again")

    def _run_publish(self, step: int, sink: str, export_dir: Path, step_dir: Path) -> Any:
        """Worker thread: one sink's publish, with progress and the test pause hook."""
        from stagerd.ops.progress import progress

        metadata = dict(layout.read_marker(step_dir).metadata)
        with contextlib.ExitStack() as stack:
            bar: Callable[[int, int], None] | None = None

            def report(done: int, total: int) -> None:
                nonlocal bar
                if bar is None:
                    bar = stack.enter_context(progress(f"publish step {step} to {sink}", total))
                    self._test_pause("publish", step)
                bar(done, total)

            return self._sinks[sink].publish(export_dir, step, metadata=metadata, progress=report)

    # -- retention, disk, metrics ------------------------------------------------------------------------

    async def _retain(self) -> None:
        """Delete the staged data that retention allows, oldest first."""
        if self.settings.keep_last is None:
            return
        rows = await self._j(self._journal.steps, include_retired=False)
        views = [StepView(r.step, r.state == PUBLISHED) for r in rows]
        by_step = {r.step: r for r in rows}
        for step in plan_retention(views, self.settings.keep_last):
            if self._stopping:
                return
            row = by_step[step]
            await self._trash(move_to_trash, self.root, row.path)
            await self._j(self._journal.retire, step, f"retention: keep_last={self.settings.keep_last}")
            self._transition(
                step, None, RETIRED, note=f"staged data deleted (keep_last={self.settings.keep_last})"
            )
        await self._trash(empty_trash, self.root)

    async def _check_disk(self) -> None:
        s = self.settings
        disk = await self._io(
            disk_state, self.root, low_percent=s.low_disk_free_percent, low_bytes=s.low_disk_free_bytes
        )
        if disk.low and (self._disk is None or not self._disk.low):
            log.warning(
                "low disk on %s: %.1f GB free (%.1f%%); unpublished steps are never deleted, so publishing "
                "must catch up or space must be freed",
                self.root,
                disk.free / 1e9,
                disk.free_percent,
                extra={"disk_free": disk.free, "disk_low": True},
            )
        elif not disk.low and self._disk is not None and self._disk.low:
            log.info("disk space on %s recovered: %.1f GB free", self.root, disk.free / 1e9)
        self._disk = disk
        self.metrics.disk_free.set(disk.free)
        self.metrics.disk_low.set(int(disk.low))
        self._health.update(disk_free=disk.free, disk_low=disk.low)

    async def _refresh(self) -> None:
        """Refresh gauges, the health snapshot and the systemd status line from the journal."""
        j = self._journal
        counts = await self._j(j.counts)
        lane_counts = await self._j(j.lane_counts)
        rows = await self._j(j.steps, include_retired=False)
        self.metrics.set_counts(counts, lane_counts, self._sinks)
        self.metrics.queue_depth.labels(stage="export", sink="").set(counts[COMMITTED] + counts[FAILED])
        for sink in self._sinks:
            waiting = lane_counts.get((sink, PENDING), 0) + lane_counts.get((sink, FAILED), 0)
            self.metrics.queue_depth.labels(stage="publish", sink=sink).set(waiting)
        unpublished = [r.marker_mtime for r in rows if r.state not in (PUBLISHED, RETIRED)]
        self.metrics.oldest_unpublished.set(time.time() - min(unpublished) if unpublished else 0.0)
        self._health["steps"] = counts
        to_export = counts[COMMITTED] + counts[FAILED]
        to_publish = sum(
            lane_counts.get((s, PENDING), 0) + lane_counts.get((s, FAILED), 0) for s in self._sinks
        )
        notify.notify_status(
            f"{counts[PUBLISHED] + counts[RETIRED]} published, {to_export} to export, "
            f"{to_publish} to publish, {counts[QUARANTINED]} quarantined"
            + (", LOW DISK" if self._disk is not None and self._disk.low else "")
        )

    async def _housekeeping(self) -> None:
        """Disk check, retention and gauges: every `disk_check_seconds`, and whenever a step publishes."""
        while not self._stopping:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._housekeep.wait(), timeout=self.settings.disk_check_seconds)
            self._housekeep.clear()
            try:
                if not self._journal_backing_off():
                    await self._retain()
                await self._check_disk()
                await self._try_refresh()
            except JournalError as e:
                self._journal_down(e, "apply retention")
            except (OSError, StagerdError) as e:
                log.warning("housekeeping failed: %s", e)

    async def _ticker(self) -> None:
        """Loop heartbeat for /healthz, and systemd watchdog pings at half the watchdog interval."""
        wd = notify.watchdog_interval()
        period = min(1.0, wd / 2) if wd else 1.0
        while True:
            self._beat = time.monotonic()
            if wd:
                notify.notify_watchdog()
            await asyncio.sleep(period)

    def _healthz(self) -> tuple[bool, dict[str, Any]]:
        """Called from the metrics thread: healthy while the loop beats."""
        age = time.monotonic() - self._beat
        body = {**self._health, "loop_lag_seconds": round(age, 3)}
        ok = age < HEALTH_STALE_SECONDS and body.get("status") in ("ok", "stopping")
        return ok, body

    # -- the end of a --once run -------------------------------------------------------------------------

    async def _summary(self) -> Summary:
        rows = await self._j(self._journal.steps)
        lanes = await self._j(self._journal.lanes)
        out = Summary()
        for r in rows:
            if r.state in (PUBLISHED, RETIRED):
                out.published.append(r.step)
                continue
            why = [f"{r.state}: {r.error_class}: {r.error_message}"] if r.error_class else [r.state]
            why += [
                f"{ln.sink} {ln.state}: {ln.error_class}: {ln.error_message}"
                for ln in lanes
                if ln.step == r.step and ln.state != PUBLISHED
            ]
            out.unpublished.append((r.step, "; ".join(why)))
        return out

    def _report(self, summary: Summary) -> int:
        if summary.ok:
            log.info(
                "--once: all %d step(s) published",
                len(summary.published),
                extra={"published": summary.published},
            )
            return 0
        log.error(
            "--once: %d step(s) published, %d NOT published",
            len(summary.published),
            len(summary.unpublished),
            extra={"published": summary.published, "unpublished": [s for s, _ in summary.unpublished]},
        )
        for step, why in summary.unpublished:
            log.error("step %d not published: %s", step, why, extra={"step": step, "state": "unpublished"})
        return 1
