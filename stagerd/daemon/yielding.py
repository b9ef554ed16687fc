"""The daemon yields the disk to saves being written on its node.

A trainer's save is on the training's critical path; the daemon's export and a `file://` publish are not,
and they compete for the same disk. So while some step directory in ROOT is being written (no commit
marker, a file under its staged parts changed moments ago), their worker threads pause between moves or
chunks, for at most `yield_seconds` in total per export or publish, its retries included (`YieldLedger`),
so a save that never ends cannot starve the daemon. Nothing of the Stager's protocol is needed: mtimes
alone tell a save in flight.

With `--adopt` the saves are the trainer's own checkpoints (`WritingCheckpoints`): a directory of ROOT
whose name gives a step, not finished by its preset's rule (the rule the daemon's scan follows), with a file
anywhere under it changed moments ago. Those trainers save on the training ranks themselves, so there the
disk the export takes is taken from the training loop directly.
"""

from __future__ import annotations

import logging
import os
import re
import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path

from stagerd.contract import layout
from stagerd.contract.adopt.step_names import compile_step_regex, parse_step_name
from stagerd.daemon.state import DaemonState, log
from stagerd.daemon.tree_scan import Trees
from stagerd.errors import ConfigError
from stagerd.sinks.urls import SinkKind, parse_sink_url

# mtimes change on write, not on fsync: a writer flushing a multi-GB file before its marker makes no mtime
# update for a second or two. 3 s covers that flush, and a save that stalled or died counts as over 3 s
# after its last write.
WRITE_WINDOW_SECONDS = 3.0
CACHE_SECONDS = 0.1  # every worker thread asks after each move or chunk: one scan answers them all
SLICE_SECONDS = 0.05
MAX_ENTRIES = 256  # per Stager step directory: a few files per rank; a huge tree is not walked
# A file of a checkpoint written this long after its preset's last completion file is a save still going
# on (see `WritingCheckpoints`); within it, the other ranks' own small files of the same save.
AFTER_FINISH_SECONDS = 1.0
# A trainer saves its newest step (see `WritingCheckpoints`): the older checkpoints, every one without a
# save_total_limit, would each hold their entries in memory and share the stats of a scan.
MAX_CHECKPOINTS = 8
OLDER_PER_SCAN = 64
STATS_PER_SCAN = 256  # of files, per scan, among the walked checkpoints: about 1 ms (RELIABILITY.md)
_PARTS = frozenset((layout.MODEL_DIR, layout.OPTIM_DIR, layout.EXTRAS_DIR))
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def written_within(
    step_dir: Path,
    lo: float,
    hi: float,
    max_entries: int = MAX_ENTRIES,
    parts: frozenset[str] | None = _PARTS,
) -> bool:
    """Whether an entry under the step's staged parts (`parts` None: anywhere under it) has an mtime in
    [lo, hi]. Links are never followed; a directory that vanished or cannot be read counts as not written,
    and so does one of more than `max_entries` entries."""
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
                        if fd == top and parts is not None and e.name not in parts:
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


class WritingCheckpoints:
    """`--adopt`: the trainer's checkpoint directories in ROOT (named as the scan names them) with an entry
    under them written within the last `window` seconds while not finished (`finished_at`, the daemon's
    own rule: None until then), or more than `AFTER_FINISH_SECONDS` after it was; newest first. Called
    as a `SavesInFlight` scan; each checkpoint's entries are remembered between calls (`tree_scan.Trees`),
    so a call's cost is bounded however many files a checkpoint holds.

    The newest `MAX_CHECKPOINTS` by step are walked: a trainer saves the step it is at, above every one it
    saved before. An older one is walked too while written (a run restarted from an earlier checkpoint
    saves below the abandoned run's leftovers): its directory's own mtime, `OLDER_PER_SCAN` of them stat'ed
    a call in turn, shows a save creating its files.

    The HF Trainer (`Trainer._save_checkpoint`, transformers 5.24) writes `save_model`'s files, then the
    optimizer (FSDP: the model's DCP again, then the optimizer's), scheduler, scaler and each rank's
    `rng_state_R.pth`, and rank 0's `trainer_state.json` last: its preset's completion file ends the save
    but for the other ranks' RNG states (a few KB, at that moment). After it come only the rotation's
    deletes of older checkpoints, which touch their directories: a moment's yield to the trainer's own
    disk work. Lightning's `meta.pt`, DCP's `.metadata` (torchtitan) and AutoModel's `.incomplete`
    removal end theirs too. Accelerate's `save_state` is finished by the model's own files, written
    before its optimizer (several times the model's bytes): those writes after the finish keep the
    exports yielding, that checkpoint's own included, until they go quiet (`window`)."""

    def __init__(
        self,
        finished_at: Callable[[Path], float | None],
        custom: re.Pattern[str] | None = None,
        stats: int = STATS_PER_SCAN,
    ) -> None:
        self.finished_at, self.custom, self.stats = finished_at, custom, stats
        self._trees = Trees()
        self._older: set[Path] = set()  # older checkpoints found written: walked until they go quiet
        self._older_pos = 0

    def __call__(self, root: Path, window: float) -> tuple[int, ...]:
        now = time.time()
        lo, hi = now - window, now + window
        try:
            entries = list(os.scandir(root))
        except OSError:
            return ()
        named = []
        for e in entries:
            if e.name.startswith(".") or not e.is_dir(follow_symlinks=False):
                continue  # `.stagerd/`, where the exports are built, and single-file checkpoints
            step = parse_step_name(e.name, self.custom)
            if step is not None:
                named.append((step, Path(e.path)))
        named.sort(key=lambda sd: sd[0], reverse=True)
        self._find_older(named[MAX_CHECKPOINTS:], lo, hi)
        walked = [sd for i, sd in enumerate(named) if i < MAX_CHECKPOINTS or sd[1] in self._older]
        newest = self._trees.newest([d for _, d in walked], lo, hi, self.stats)
        self._older.intersection_update(newest)
        found = []
        for step, d in walked:
            m = newest.get(d)
            if m is None:
                continue
            done = self.finished_at(d)
            if done is None or m >= done + AFTER_FINISH_SECONDS:
                found.append(step)
        return tuple(found)

    def _find_older(self, older: list[tuple[int, Path]], lo: float, hi: float) -> None:
        if not older:
            return
        start = self._older_pos % len(older)
        self._older_pos = start + OLDER_PER_SCAN
        for _, d in (older[start:] + older[:start])[:OLDER_PER_SCAN]:
            try:
                m = os.stat(d, follow_symlinks=False).st_mtime
            except OSError:
                continue
            if lo <= m <= hi:
                self._older.add(d)


class SavesInFlight:
    """`writing_steps` of one ROOT (or what `scan` finds there), answered from a scan at most
    `CACHE_SECONDS` old, for any thread. `own`: a step's own save counts for its export too."""

    def __init__(
        self,
        root: Path,
        window: float = WRITE_WINDOW_SECONDS,
        scan: Callable[[Path, float], tuple[int, ...]] = writing_steps,
        own: bool = False,
    ) -> None:
        self.root, self.window, self.scan, self.own = root, window, scan, own
        self._lock = threading.Lock()
        self._at = -float("inf")
        self._steps: tuple[int, ...] = ()

    def writing(self, skip: int) -> int | None:
        """A step other than `skip` whose save is being written, or None."""
        with self._lock:
            if time.monotonic() - self._at >= CACHE_SECONDS:
                self._steps = self.scan(self.root, self.window)
                self._at = time.monotonic()
            steps = self._steps
        return next((s for s in steps if s != skip or self.own), None)


YieldKey = tuple[str, int, "str | None", "str | None"]  # (stage, step, lane or None, the save's identity)


class YieldLedger:
    """The seconds each export or publish has yielded in this daemon's life, over all its tries: a step
    whose export keeps failing gets one budget in all, not one per retry. A new save of the step (another
    identity) starts afresh. In memory: a restart starts every budget afresh, so a daemon restarted in a
    loop could yield for ever; each of its lives still yields at most the budget."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spent: dict[YieldKey, float] = {}

    def spent(self, key: YieldKey) -> float:
        with self._lock:
            return self._spent.get(key, 0.0)

    def add(self, key: YieldKey, seconds: float) -> None:
        with self._lock:
            self._spent[key] = self._spent.get(key, 0.0) + seconds

    def forget(self, step: int, lane: str | None = None, *, every_lane: bool = False) -> None:
        """A step published everywhere (`every_lane`), or quarantined on `lane` (None: its export), has no
        retry left to budget for (`stagerd retry` then starts afresh)."""
        with self._lock:
            for k in [k for k in self._spent if k[1] == step and (every_lane or k[2] == lane)]:
                del self._spent[k]


class Yielder:
    """One export's or publish's pauses, called after each move or chunk by any of its threads. The budget
    is wall time during which at least one of its threads paused, counted in `ledger` under `key` with its
    earlier tries'. `spent`: this try's."""

    def __init__(
        self,
        saves: SavesInFlight,
        what: str,
        step: int,
        budget: float,
        stopping: Callable[[], bool],
        ledger: YieldLedger | None = None,
        key: YieldKey | None = None,
    ) -> None:
        self.saves, self.what, self.step, self.budget, self.stopping = saves, what, step, budget, stopping
        self.on_waited: Callable[[float], None] = lambda seconds: None
        self.ledger, self.key = ledger or YieldLedger(), key or (what, step, None, None)
        self.before = self.ledger.spent(self.key)
        self.spent = 0.0
        self._lock = threading.Lock()
        self._paused = 0  # threads pausing now
        self._since = 0.0
        self._episodes = 0

    def _left(self) -> float:
        running = time.monotonic() - self._since if self._paused else 0.0
        return self.budget - self.before - self.spent - running

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
            left = self.budget - self.before - self.spent
        if first:
            log.info(
                "%s of step %d yields the disk to the save of step %d being written (at most %.0fs)",
                self.what,
                self.step,
                busy,
                left,
                extra={"step": self.step, "yields_to": busy, "stage": self.what, "sink": self.key[2]},
            )

    def _leave(self, busy: int | None) -> None:
        with self._lock:
            self._paused -= 1
            if self._paused:
                return
            waited = time.monotonic() - self._since
            self.spent += waited
            self.ledger.add(self.key, waited)
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
            extra={
                "step": self.step,
                "stage": self.what,
                "sink": self.key[2],
                "yielded_seconds": round(waited, 3),
            },
        )


def yields_disk(sink: str) -> bool:
    """A `file://` sink writes the same disks; a remote sink's cost is the network, and it never yields."""
    try:
        return parse_sink_url(sink).kind is SinkKind.LOCAL
    except ConfigError:  # a redacted URL that no longer parses is not a local path
        return False


class Yielding(DaemonState):
    _saves: SavesInFlight
    _yield_ledger: YieldLedger

    def _finished_at(self, ckpt: Path) -> float | None:
        raise NotImplementedError  # `Adoption`'s

    def _saves_in_flight(self) -> SavesInFlight:
        if self.settings.adopt is None:
            return SavesInFlight(self.root)
        custom = compile_step_regex(self.settings.adopt_step)
        # A checkpoint is exported once its preset finds it finished: still written, it is a save of its own
        # being finished (accelerate's optimizer after the model), and its export yields to it as well.
        return SavesInFlight(
            self.root,
            scan=WritingCheckpoints(self._finished_at, custom),
            own=True,
        )

    def _yielder(
        self,
        what: str,
        step: int,
        sink: str | None = None,
        *,
        identity: str | None = None,
        local: bool | None = None,
    ) -> Yielder:
        """The pause hook of one export (`sink` None) or one publish to `sink` (a lane's key), its budget
        shared by its retries of the save `identity`. `local`: whether its writes go to this node's disk
        (default: an export, or a publish to a `file://` sink)."""
        if local is None:
            local = sink is None or yields_disk(sink)
        budget = self.settings.yield_seconds if local else 0.0
        key = (what, step, sink, identity)
        y = Yielder(self._saves, what, step, budget, lambda: self._stopping, self._yield_ledger, key)
        y.on_waited = self.metrics.yield_seconds.labels(stage=what).inc
        return y
