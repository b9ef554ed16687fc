"""The work itself: one task per step export and one per (step, sink) publish.

Each task journals its intent, runs the blocking work in a worker thread (exports in the export pool,
publishes in their sink's own lane), then records the result; a failure is recorded by the retry policy.
The result objects flow from the engine and the sinks straight into the journal, so nothing is re-read
from disk to record or report them.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Callable, Mapping
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.filesize import decimal

from stagerd.contract import commit_marker, layout
from stagerd.contract.step.held import held_child, refuse_links
from stagerd.daemon.adopt import OTHER_CHECKS, unexportable
from stagerd.daemon.adopt_retired import RetiredAdoption
from stagerd.daemon.discovery import save_identity
from stagerd.daemon.fleet.exchange import Stopped
from stagerd.daemon.fleet.tasks import FleetTasks, is_fleet_step
from stagerd.daemon.gate import Abandoned
from stagerd.daemon.health import Health
from stagerd.daemon.journal import (
    COMMITTED,
    EXPORTED,
    EXPORTING,
    PUBLISHED,
    PUBLISHING,
    QUARANTINED,
    LaneState,
)
from stagerd.daemon.state import log
from stagerd.daemon.work_failures import WorkFailures
from stagerd.daemon.yielding import Yielder, Yielding
from stagerd.errors import JournalError, MarkerError
from stagerd.ops.crashpoints import crash_point
from stagerd.sinks.base import PublishResult

OTHER_OPTIONS = "export/ was made with another --dtype, --keep-dtype or extras than asked now"

if TYPE_CHECKING:
    from stagerd.engine.export import ExportResult

# TEST ONLY, read from the environment and never a setting: the worker sleeps inside its first progress
# report of every export ("export") or publish ("publish"), so a test can kill the daemon mid-way.
TEST_PAUSE_AT_ENV = "STAGERD_TEST_PAUSE_AT"
TEST_PAUSE_SECONDS_ENV = "STAGERD_TEST_PAUSE_SECONDS"

# What of a step directory the daemon reads, writes or deletes: the staged parts, and its export's.
STAGED_PARTS = (layout.MARKER_NAME, layout.MODEL_DIR, layout.EXTRAS_DIR, layout.OPTIM_DIR)
EXPORT_PARTS = (layout.EXPORT_DIR, layout.EXPORT_TMP_DIR, layout.EXPORT_OPTIONS_NAME)


def _test_pause(where: str, step: int) -> None:
    if os.environ.get(TEST_PAUSE_AT_ENV) == where:
        log.warning("test pause at %s of step %d", where, step, extra={"test_pause": where, "step": step})
        time.sleep(float(os.environ.get(TEST_PAUSE_SECONDS_ENV, "3600")))


class Tasks(FleetTasks, Health, RetiredAdoption, WorkFailures, Yielding):
    _marker_metadata: dict[int, Mapping[str, Any]]

    async def _export(self, step: int, step_dir: Path) -> None:
        """One step's export task: begin, export, record; a journal error ends it quietly."""
        try:
            await self._export_step(step, step_dir)
        except JournalError as e:  # reading the step or beginning its export: nothing was started
            self._journal_down(e, f"start the export of step {step}")
        except Abandoned:
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
        self._log_step(step, None, EXPORTING, attempt=attempt)
        await self._try_refresh()
        # An export made with other options may be rebuilt only while no sink holds it.
        lanes = await self._j(self._journal.lanes, step)
        rebuild = not any(ln.state in (LaneState.PUBLISHED, LaneState.PUBLISHING) for ln in lanes)
        # one whose extras alone changed (config.json given since): its weights are what the sinks hold
        rebuild_extras = not any(ln.state == LaneState.PUBLISHING for ln in lanes)
        identity = None if row is None else row.marker_id
        t0, pause = time.monotonic(), self._yielder("export", step, identity=identity)
        try:
            result = await asyncio.get_running_loop().run_in_executor(
                self._export_pool, self._run_export, step, step_dir, rebuild, rebuild_extras, pause
            )
        except asyncio.CancelledError:
            raise
        except Stopped:
            return await self._fleet_stopped(step, None)
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
            self.metrics.exported_bytes.inc(export_bytes if result.own_bytes is None else result.own_bytes)
            self.metrics.export_seconds.observe(seconds)
        self._log_step(
            step,
            None,
            EXPORTED,
            note=f"{decimal(export_bytes)} in {seconds:.2f}s"
            + (", already complete" if result.skipped else "")
            + (f", {pause.spent:.2f}s of it yielding to a save" if pause.spent else ""),
            seconds=round(seconds, 3),
            bytes=export_bytes,
            skipped=result.skipped,
            yielded_seconds=round(pause.spent, 3),
        )

    def _run_export(
        self, step: int, step_dir: Path, rebuild: bool, rebuild_extras: bool, pause: Yielder
    ) -> ExportResult:
        """Worker thread: the export engine, with progress and the test pause hook; a node-locally staged
        step is this node's part of the fleet export instead."""
        from stagerd.engine.export import export_step

        self._refuse_links(step, step_dir, STAGED_PARTS, EXPORT_PARTS)
        if is_fleet_step(step_dir):
            return self._run_fleet(step, step_dir, pause)
        from stagerd.ops.progress import progress

        with contextlib.ExitStack() as stack:
            bar: Callable[[int, int], None] | None = None

            def report(done: int, total: int) -> None:
                nonlocal bar
                crash_point("export.move")
                if bar is None:
                    bar = stack.enter_context(progress(f"export step {step}", total))
                    _test_pause("export", step)
                bar(done, total)
                pause()  # between moves: a save being written on this disk goes first

            s = self.settings
            if s.adopt is not None:
                return self._export_adopted(step, step_dir, report, rebuild, rebuild_extras)
            return export_step(
                step_dir, mapping=s.mapping, progress=report, rebuild=rebuild, **s.export_options()
            )

    def _refuse_links(
        self, step: int, step_dir: Path, staged: tuple[str, ...], built: tuple[str, ...] = ()
    ) -> None:
        """`SymlinkError` where the step's directory, or a part of it (`staged`) or of its export's (`built`)
        that the daemon reads, writes or deletes, is now a symbolic link. The scan journals only a real
        directory; one replaced by a link since would lead every read, write and delete outside ROOT."""
        why = "the daemon journaled a real directory here and never reads, writes or deletes through a link"
        hint = (
            "replace the link by the real directory or file it stands for (its target was left as it is), "
            f"then `stagerd retry ROOT --step {step}`"
        )
        work = self._work_dir(step_dir)
        if work == step_dir:
            refuse_links(step_dir, (*staged, *built), why=why, hint=hint)
            return
        refuse_links(step_dir, why=why, hint=hint)  # an adopted checkpoint: the trainer's own layout
        refuse_links(work, built, why=why, hint=hint)

    async def _publish(self, step: int, sink: str) -> None:
        """One (step, sink) publish task: begin, publish, record; a journal error ends it quietly."""
        try:
            await self._publish_step(step, sink)
        except JournalError as e:  # reading the step, sending it back, or beginning: nothing was published
            self._journal_down(e, f"start the publish of step {step} on {sink}")
        except Abandoned:
            pass  # logged where it was given up
        finally:
            self._inflight_publishes.pop((step, sink), None)
            await self._try_refresh()
            self._wake.set()

    async def _publish_step(self, step: int, sink: str) -> None:
        row = await self._j(self._journal.step, step)
        assert row is not None
        export_dir = self._work_dir(Path(row.path)) / layout.EXPORT_DIR
        fleet = self._adopt_root is None and await self._io(is_fleet_step, Path(row.path))
        if not fleet and not await self._io(export_dir.is_dir):
            await self._export_vanished(step, Path(row.path))
            return
        if await self._io(self._checked_otherwise, Path(row.path)):
            await self._export_vanished(step, Path(row.path), OTHER_CHECKS)
            return
        if not fleet and await self._io(self._made_otherwise, Path(row.path)):
            # a sink added since, under another --dtype: the export task rebuilds it, or names the clash
            await self._export_vanished(step, Path(row.path), OTHER_OPTIONS)
            return
        attempt = await self._j(self._journal.begin_publish, step, sink)
        self._journal_up()
        self._log_step(step, sink, PUBLISHING, attempt=attempt)
        await self._try_refresh()
        try:
            await self._io(self._refuse_links, step, Path(row.path), (layout.MARKER_NAME,), EXPORT_PARTS)
            metadata = await self._io(self._metadata, step, Path(row.path))
            # a no-op but for file:// sinks, and a fleet lane's own run, which builds on this node's disk
            local = True if fleet else None
            pause = self._yielder("publish", step, sink, identity=row.marker_id, local=local)
            work = (
                partial(self._fleet_publish, step, sink, pause)
                if fleet
                else partial(self._run_publish, step, sink, export_dir, metadata, pause)
            )
            result = await asyncio.get_running_loop().run_in_executor(self._lane_pools[sink], work)
        except asyncio.CancelledError:
            raise
        except Stopped:
            return await self._fleet_stopped(step, sink)
        except Exception as e:
            await self._work_failed(step, sink, attempt, e)
            return
        crash_point("publish.done")
        await self._lane_published(step, sink, row.marker_mtime, result, what="publish")

    async def _lane_published(
        self, step: int, lane: str, marker_mtime: float, result: PublishResult, *, what: str
    ) -> None:
        """Record a lane's finished publish (retried with this result, never published again), report it,
        run the sink's retention, and note the step once every lane holds it."""
        done = await self._record(
            f"record the {what} of step {step} on {lane}",
            self._journal.finish_publish,
            step,
            lane,
            sinks=self._lane_keys(),
            seconds=result.seconds,
            bytes_total=result.bytes_total,
            bytes_uploaded=result.bytes_uploaded,
            location=result.location,
            skipped=result.skipped,
        )
        self._sink_up(lane)  # it answers: a --once run's count of its failed tries starts again
        self.metrics.published_bytes.labels(sink=lane).inc(result.bytes_uploaded)
        self.metrics.publish_seconds.labels(sink=lane).observe(result.seconds)
        self._log_step(
            step,
            lane,
            PUBLISHED,
            note=f"{result.location}, {decimal(result.bytes_uploaded)} uploaded "
            f"in {result.seconds:.2f}s" + (", already there" if result.skipped else ""),
            seconds=round(result.seconds, 3),
            bytes=result.bytes_uploaded,
            skipped=result.skipped,
        )
        await self._after_publish(lane)
        if done:
            self._marker_metadata.pop(step, None)
            self._yield_ledger.forget(step, every_lane=True)
            total = time.time() - marker_mtime
            self._log_step(step, None, PUBLISHED, note=f"on every sink, {total:.2f}s after its marker")
            self._housekeep.set()

    async def _after_publish(self, lane: str) -> None:
        """A lane published a step: the hook remote retention runs on (`RawTasks`)."""

    def _metadata(self, step: int, step_dir: Path) -> Mapping[str, Any]:
        """The run metadata in the step's marker, for model cards: read once per step, not per lane."""
        known = self._marker_metadata.get(step)
        if known is None and self._adopt_root is not None:
            known = self._marker_metadata[step] = {"adopted_from": step_dir.name}
        if known is None:
            known = self._marker_metadata[step] = dict(commit_marker.read_marker(step_dir).metadata)
        return known

    async def _export_vanished(self, step: int, step_dir: Path, why: str = "export/ disappeared") -> None:
        """export/ is gone (or was made under other checks) before every sink had it: export again, or
        quarantine if the step is gone too."""
        if not await self._io(step_dir.is_dir):
            error, msg = unexportable(step_dir, why)
            await self._j(self._journal.quarantine_step, step, error, msg)
            self._log_step(step, None, QUARANTINED, error_class=error, note=msg)
            return
        row = await self._j(self._journal.step, step)
        try:
            identity: str | None = await self._io(
                save_identity if self._adopt_root is None else self._adopted_identity, step_dir
            )
        except MarkerError:
            identity = None
        if row is not None and row.marker_id is not None and identity != row.marker_id:
            # Saved again meanwhile: exporting it would give this sink other weights than the sinks that
            # already hold the old save. The scan decides (a new version, or a conflict).
            await self._scan()
            return
        try:
            await self._j(self._journal.reexport, step, f"{why}; exporting again")
        except JournalError:
            row = await self._j(self._journal.step, step)
            if row is not None and row.state in (EXPORTED, PUBLISHED):
                raise  # not another lane sending it back first: a real journal failure
            return
        self._log_step(step, None, COMMITTED, note=f"{why}; exporting again")

    def _made_otherwise(self, step_dir: Path) -> bool:
        """Io thread: the step's export was made with another `--dtype` or `--keep-dtype` than this daemon
        asks (without `--dtype`, a Stager step's is its marker's hint, which the export task reads), or,
        adopted, with other extras than it would take now (`--extras DIR` given since)."""
        from stagerd.contract.dtypes import parse_export_dtype
        from stagerd.engine.made_with import recorded_options

        recorded = recorded_options(self._work_dir(step_dir))
        if recorded is None:
            return False
        s = self.settings
        if s.dtype is not None and recorded.get("dtype") != (parse_export_dtype(s.dtype) or "keep"):
            return True
        return recorded.get("keep_dtype") != s.keep_dtype or self._other_extras(step_dir, recorded)

    def _run_publish(
        self, step: int, sink: str, export_dir: Path, metadata: Mapping[str, Any], pause: Yielder
    ) -> PublishResult:
        """Worker thread: one sink's publish, with progress, its yield and the test pause hook."""
        from stagerd.ops.progress import progress

        with contextlib.ExitStack() as stack:
            bar: Callable[[int, int], None] | None = None

            def report(done: int, total: int) -> None:
                nonlocal bar
                if bar is None:
                    bar = stack.enter_context(progress(f"publish step {step} to {sink}", total))
                    _test_pause("publish", step)
                bar(done, total)
                pause()

            def publish(path: Path) -> PublishResult:
                return self._sinks[sink].publish(path, step, metadata=dict(metadata), progress=report)

            try:  # read through held handles: a link put at the step or export/ later is not followed
                held = stack.enter_context(held_child(export_dir))
            except FileNotFoundError:
                return publish(export_dir)  # gone meanwhile: the sink names that as it always did
            with held.naming():
                return publish(held.proc)
