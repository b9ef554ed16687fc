"""The raw publish task (`--publish-raw`): one committed step's staged files to one fsspec sink's raw prefix.

Like a publish: the lane's intent is journaled first (`begin_raw`), the upload runs in the lane's own
threads (`FsspecSink.publish_raw`: upload, verify, then its manifest, created only if absent, then
`raw/latest`), and the result is recorded with `finish_publish`, retried until it lands, never redone. A
failure goes through the same retry policy and quarantine. A re-run finds the manifest and uploads nothing,
so a crash between the manifest and the journal's record publishes the step once.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Callable
from pathlib import Path

from stagerd.contract.step.held import HeldDir
from stagerd.daemon.gate import Abandoned
from stagerd.daemon.journal import PUBLISHING
from stagerd.daemon.journal.raw import RAW_LANE_PREFIX
from stagerd.daemon.state import log
from stagerd.daemon.tasks import STAGED_PARTS, Tasks, _test_pause
from stagerd.daemon.yielding import yields_disk
from stagerd.errors import JournalError
from stagerd.ops.crashpoints import crash_point
from stagerd.sinks.base import PublishResult


class RawTasks(Tasks):
    async def _publish_raw(self, step: int, key: str) -> None:
        """One (step, raw lane) task: begin, publish raw, record; a journal error ends it quietly."""
        try:
            await self._publish_raw_step(step, key)
        except JournalError as e:
            self._journal_down(e, f"start the raw publish of step {step} on {key}")
        except Abandoned:
            pass
        finally:
            self._inflight_publishes.pop((step, key), None)
            await self._try_refresh()
            self._wake.set()

    async def _publish_raw_step(self, step: int, key: str) -> None:
        row = await self._j(self._journal.step, step)
        assert row is not None
        attempt = await self._j(self._journal.begin_raw, step, key)
        self._journal_up()
        self._log_step(step, key, PUBLISHING, attempt=attempt)
        try:
            result = await asyncio.get_running_loop().run_in_executor(
                self._lane_pools[key], self._run_raw, step, key, Path(row.path), row.marker_id
            )
        except asyncio.CancelledError:
            raise
        except Exception as e:
            await self._work_failed(step, key, attempt, e)
            return
        crash_point("publish.done")
        await self._lane_published(step, key, row.marker_mtime, result, what="raw publish")

    async def _after_publish(self, lane: str) -> None:
        """Remote retention of the sink a lane just published a verified step to, in the lane's threads.

        Also run once at start, to finish a prune a killed daemon left. A failure is logged and left for
        the next publish or start: the publish itself stands."""
        url = lane.removeprefix(RAW_LANE_PREFIX)
        if url not in self._prune_stores:
            return
        from stagerd.sinks.prune import prune

        store, policy, owner = self._prune_stores[url]
        run = functools.partial(prune, store, policy, owner=owner)
        try:
            await asyncio.get_running_loop().run_in_executor(self._lane_pools[lane], run)
        except Exception as e:
            log.warning(
                "remote retention on %s failed: %s; tried again after the next publish or start",
                url,
                e,
                extra={"sink": url, "error_class": type(e).__name__},
            )

    def _run_raw(self, step: int, key: str, step_dir: Path, identity: str | None = None) -> PublishResult:
        """Worker thread: one raw publish, with progress and the test pause hook."""
        from stagerd.ops.progress import progress

        self._refuse_links(step, step_dir, STAGED_PARTS)
        local = yields_disk(key.removeprefix(RAW_LANE_PREFIX))  # a file:// raw prefix writes this disk
        pause = self._yielder("publish", step, key, identity=identity, local=local)
        with contextlib.ExitStack() as stack:
            bar: Callable[[int, int], None] | None = None

            def report(done: int, total: int) -> None:
                nonlocal bar
                if bar is None:
                    bar = stack.enter_context(progress(f"raw publish of step {step} to {key}", total))
                    _test_pause("publish", step)
                bar(done, total)
                pause()

            # Read through the step held open: a link put at its path after the check leads no read
            # elsewhere (a gone step is named by the sink as before).
            try:
                held = stack.enter_context(HeldDir.open(step_dir))
            except FileNotFoundError:
                return self._raw_sinks[key].publish_raw(step_dir, step, progress=report)
            # the sink opens each listed file from it (and its subdirectories), none through a link
            return self._raw_sinks[key].publish_raw(held, step, progress=report)
