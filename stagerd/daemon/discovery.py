"""Finding steps: a scan of ROOT for committed steps the journal does not know, run on watchfiles events
and by a periodic rescan; and recovery at start, which puts a crashed run's in-flight work back."""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import stat
import time
from pathlib import Path

from stagerd.contract import commit_marker, layout
from stagerd.contract.step.lock import clear_stale
from stagerd.daemon.gate import JournalGate
from stagerd.daemon.journal import (
    COMMITTED,
    EXPORTED,
    FAILED,
    PENDING,
    PUBLISHED,
    QUARANTINED,
    RETIRED,
    StepState,
)
from stagerd.daemon.journal.versions import CONFLICT, REARMED
from stagerd.daemon.policy import rearmable
from stagerd.daemon.state import log
from stagerd.daemon.summary import NEWEST_LISTED, missed_text
from stagerd.daemon.unfinished import MARKER_RULE, Unfinished, newest_of
from stagerd.errors import JournalError, MarkerError, StagerdError, StepConflictError

# A marker's stat that fails so until a person acts: a link loop, a directory the daemon may not enter.
_FOR_GOOD = frozenset({errno.ELOOP, errno.EACCES, errno.EPERM})


def save_identity(step_dir: Path) -> str:
    """`commit_marker.marker_identity`, except for a marker no export would read (over `read_marker`'s 64 MiB
    limit, or not a regular file): reading it whole took the memory it claimed (1 TiB sparse: MemoryError,
    the daemon gone) or, a FIFO, held the scan for good; nor one the daemon can never read (a link loop, no
    permission), which failed every scan whole or was passed over without a word. Such a step gets an
    identity from its stat, so that it is journaled and its export names the error (quarantined) while the
    others go on."""
    marker = step_dir / layout.MARKER_NAME
    try:
        st = marker.stat()
    except FileNotFoundError:
        raise MarkerError("no commit marker: the step is not committed", path=step_dir) from None
    except OSError as e:
        if e.errno in _FOR_GOOD:  # one step's, not the scan's: journaled, its export names the error
            return f"unreadable:{e.errno}"
        # one that may pass (an I/O error): not journaled, the next scan tries again
        raise MarkerError(f"cannot stat the commit marker: {e.strerror}", path=step_dir) from None
    if not stat.S_ISREG(st.st_mode) or st.st_size > commit_marker.MAX_MARKER_BYTES:
        return f"unreadable:{stat.S_IFMT(st.st_mode)}:{st.st_size}"
    try:
        return commit_marker.marker_identity(step_dir)
    except MarkerError:
        if os.path.lexists(marker) and not os.access(marker, os.R_OK):  # no later scan would read it
            return f"unreadable:{st.st_mtime_ns}:{st.st_size}"
        raise  # deleted since the stat (not committed), or a read that may pass: the next scan tries


def _marker_mtime(marker: Path) -> float:
    """The marker's mtime; its link's own, where what it leads to cannot be found (FileNotFoundError where
    neither exists: not committed)."""
    try:
        return marker.stat().st_mtime
    except FileNotFoundError:
        raise
    except OSError as e:
        if e.errno not in _FOR_GOOD:
            raise MarkerError(f"cannot stat the commit marker: {e.strerror}", path=marker) from None
    try:
        return os.lstat(marker).st_mtime
    except OSError:  # a directory the daemon may not enter
        return 0.0


class Discovery(JournalGate):
    async def _left_unfinished(self, found: list[Unfinished]) -> None:
        """The saves the last scan left alone as unfinished: a `--once` summary names them, and the journal
        keeps the newest few for `stagerd status` (a half-written save a killed trainer left is otherwise
        never named by a running daemon). Written only when they change, not at every scan."""
        self._unfinished = found
        record = {
            "count": len(found),
            "newest": [list(u) for u in newest_of(found, NEWEST_LISTED)],
            "adopt": self._adopt_root is not None,
        }
        if record != self._unfinished_recorded:
            await self._j(self._journal.set_meta, unfinished=record)
            self._unfinished_recorded = record

    async def _scan(self) -> int:
        """Journal every committed step under ROOT that the journal does not know yet, and every new save
        of a step it knows (a step number saved again)."""
        Found = list[tuple[int, Path, float, str]]

        def listing() -> tuple[list[tuple[int, Path]], list[str]]:
            try:
                odd = [n for n in os.listdir(self.root) if layout.looks_like_a_step_dir(n)]
            except FileNotFoundError:
                odd = []
            return list(layout.iter_step_dirs(self.root)), odd

        Known = dict[int, tuple[float, str | None]]

        def find(dirs: list[tuple[int, Path]], known: Known) -> tuple[Found, Found, list[Unfinished]]:
            new: Found = []
            resaved: Found = []
            unfinished: list[Unfinished] = []
            for step, path in dirs:
                try:
                    mtime = _marker_mtime(path / layout.MARKER_NAME)
                    if step in known and known[step][0] == mtime:
                        continue  # the save the journal has: no need to read its marker
                    identity = save_identity(path)
                except (FileNotFoundError, MarkerError):
                    if step not in known and not os.path.lexists(path / layout.MARKER_NAME):
                        unfinished.append(Unfinished(step, path.name, MARKER_RULE))
                    continue  # not committed: never touched
                (resaved if step in known else new).append((step, path, mtime, identity))
            return new, resaved, unfinished

        dirs, odd = await self._io(listing)
        known = await self._j(self._journal.saves, [step for step, _ in dirs])
        new, resaved, unfinished = await self._io(find, dirs, known)
        await self._left_unfinished(unfinished)
        self._odd_names &= set(odd)  # warned once while there: a name gone for good is forgotten
        for name in sorted(set(odd) - self._odd_names):
            self._odd_names.add(name)
            log.warning(
                "%s is not a step directory: stagerd reads only the names it writes, step- and the step "
                "number in 8 or more ASCII digits without extra leading zeros, below 2^63 (step-00000100); "
                "it is ignored",
                self.root / name,
                extra={"ignored": name},
            )
        added = 0
        for step, path, mtime, identity in new:
            added += await self._add_step(step, path, mtime, identity)
        for step, path, mtime, identity in resaved:
            old_identity = known[step][1]
            if old_identity in (None, identity):  # a touched marker, or a row from before identities
                await self._j(self._journal.note_save, step, mtime, identity)
                continue
            added += await self._resaved(step, path, mtime, identity, old_identity)
        if added:
            self._wake.set()
            self._housekeep.set()
        return added

    async def _add_step(self, step: int, path: Path, mtime: float, identity: str) -> int:
        """Journal a step found on disk that the journal does not have; 1 if it was added."""
        if not await self._j(self._journal.add_step, step, path, mtime, identity):
            return 0
        self._log_step(step, None, COMMITTED, marker_age=round(time.time() - mtime, 3))
        return 1

    async def _resaved(self, step: int, path: Path, mtime: float, identity: str, old: str | None) -> int:
        """Journal a new save of a step the journal has (saved `old`); 1 if it is to be exported again."""
        state = await self._j(self._journal.new_save, step, path, mtime, identity, old)
        if state is StepState.COMMITTED:
            self._log_step(step, None, state, note="saved again before it was published")
            return 1
        if state is StepState.QUARANTINED:
            self._log_step(
                step,
                None,
                state,
                error_class=CONFLICT,
                note=f"saved again after it was published: {StepConflictError.hint}",
                level=logging.ERROR,
            )
        return 0

    async def _watcher(self) -> None:
        """inotify (watchfiles) on ROOT: a new marker or step directory triggers a scan."""
        import watchfiles

        def relevant(_change: watchfiles.Change, path: str) -> bool:
            return self._relevant(path)

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
                if any(os.path.basename(p) not in (layout.MARKER_NAME, ".metadata") for _, p in changes):
                    # A marker written right after its directory can beat the new directory's watch.
                    asyncio.get_running_loop().call_later(1.0, self._rescan_soon)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # inotify limits, an unsupported filesystem: the rescan still finds steps
            log.warning(
                "filesystem events unavailable (%s); relying on the %.0fs rescan",
                e,
                self.settings.rescan_seconds,
            )

    def _relevant(self, path: str) -> bool:
        """A file or directory whose event may mean a new committed step."""
        name = os.path.basename(path)
        return name == layout.MARKER_NAME or layout.parse_step_dir(name) is not None

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

    async def _rescanner(self) -> None:
        while not self._stopping:
            await asyncio.sleep(self.settings.rescan_seconds)
            await self._scan_safely()

    async def _lose_deleted(self) -> None:
        """At start, with `--adopt`: the steps whose trainer deleted their checkpoint unexported, retired as
        lost (`RetiredAdoption`)."""

    async def _revive_missed(self) -> None:
        """Retired steps a sink lacks, exported again where their data is still there (`--adopt`)."""

    async def _say_missed(self) -> None:
        """A sink added since the last run: name the retired steps it will never get (said once, at the start
        that adds it; the `--once` summary says it each time)."""
        meta = await self._j(self._journal.meta)
        before = meta.get("lanes", meta.get("sinks"))
        if before is None or self.settings.once:  # a new ROOT; `--once` says it in its summary
            return
        new = [k for k in self._lane_keys() if k not in before]
        for sink, (count, steps) in (await self._j(self._journal.missed, new, NEWEST_LISTED)).items():
            log.warning(missed_text(sink, count, steps), extra={"sink": sink, "missed": steps})

    async def _recover(self) -> None:
        """Resume after a crash: put in-flight work back, lanes for new sinks, and vanished steps aside."""
        for r in await self._j(self._journal.recover):
            self._log_step(
                r.step, r.sink, COMMITTED if r.sink is None else PENDING, note="resumed after a crash"
            )
            if r.attempts >= self.settings.max_attempts:
                what = "export" if r.sink is None else "publish"
                msg = f"the daemon died during {r.attempts} {what} attempts of this step"
                if r.sink is None:
                    await self._j(self._journal.quarantine_step, r.step, "CrashLoop", msg)
                else:
                    await self._j(self._journal.quarantine_lane, r.step, r.sink, "CrashLoop", msg)
                self._log_step(r.step, r.sink, QUARANTINED, error_class="CrashLoop", note=msg)
        for step, sink in await self._j(self._journal.rearm, rearmable):
            self._log_step(step, sink, FAILED, note=REARMED)
        for step, sink in await self._j(self._journal.ensure_lanes, self._lane_keys()):
            self._log_step(step, sink, PENDING, note="new sink")
        await self._lose_deleted()
        await self._revive_missed()
        await self._say_missed()
        for row in await self._j(self._journal.steps, include_retired=False):
            if row.state == QUARANTINED or await self._io(Path(row.path).is_dir):
                continue
            if row.state == EXPORTED and self._adopt_root is not None:
                export = self._work_dir(Path(row.path)) / layout.EXPORT_DIR
                if await self._io(layout.export_is_whole, export):
                    continue  # a trainer rotated its checkpoint away: the whole export is still published
            if row.state == PUBLISHED:  # retention moved it to the trash, then the daemon died
                await self._io(clear_stale, self.root, row.step)  # holding the step's lock: its file stays
                await self._j(self._journal.retire, row.step, "staged data already removed")
                self._log_step(row.step, None, RETIRED, note="removed before the last restart")
            else:
                msg = f"the step directory {row.path} disappeared before the step was published"
                await self._j(self._journal.quarantine_step, row.step, "MissingStep", msg)
                self._log_step(
                    row.step, None, QUARANTINED, error_class="MissingStep", note=msg, level=logging.ERROR
                )
