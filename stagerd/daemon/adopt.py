"""Adopted checkpoints (`watch --adopt`): finding the finished DCP checkpoints a trainer writes under ROOT,
knowing which save each is, and exporting them into stagerd's own directory.

A checkpoint is a direct child of ROOT whose name gives a step number (`contract/adopt/step_names.py`);
it is finished once its preset's completion files exist (DCP's `.metadata`, written by the coordinator
only after every rank's data succeeded, and the trainer's own last file where it has one). Unfinished
directories are never opened. Its journal row is an ordinary step row: the directory's name, the newest
completion file's mtime as the marker time, and `dcp:<sha256 of .metadata>` as the save's identity, so a
checkpoint re-saved in place is a new save of its step by the rules every step follows. Two directories
giving one step number are an `AdoptError` on that step, and the others go on.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stagerd.contract import layout
from stagerd.contract.adopt.checks import made_by_these_checks
from stagerd.contract.adopt.presets import LAYOUTS, Preset
from stagerd.contract.adopt.step_names import compile_step_regex, parse_step_name
from stagerd.daemon.discovery import Discovery
from stagerd.daemon.journal import QUARANTINED, StepState
from stagerd.daemon.root_places import adopt_root
from stagerd.daemon.state import log
from stagerd.daemon.trainers_best import adopted_best, staged_best
from stagerd.daemon.unadopted import (
    NO_CONFIG,
    NO_STEP,
    NO_STEP_CHECKPOINT,
    ROTATED,
    ROTATED_HINT,
    SAID_NO_CONFIG,
    SINGLE_FILE,
    holds_checkpoints,
    holds_dcp,
    unadoptable,
)
from stagerd.daemon.unfinished import NO_PRESET_RULE, Unfinished, finished_rule
from stagerd.errors import AdoptError, StagerdError

if TYPE_CHECKING:
    from stagerd.engine.export import ExportResult

OTHER_CHECKS = "export/ was made by a stagerd build whose checks differ"
# Files whose creation (or, for `.incomplete`, removal) may finish a checkpoint: a scan on their events.
COMPLETION_NAMES = frozenset(
    {".metadata"}
    | {Path(f).name for ps in LAYOUTS.values() for p in ps for f in (*p.complete, *p.detect_also)}
    | {p.incomplete for ps in LAYOUTS.values() for p in ps if p.incomplete}
)
Found = tuple[int, Path, float, str]


def unexportable(step_dir: Path, why: str) -> tuple[str, str]:
    """The error class and message of a step whose export cannot be made (again): its directory is gone."""
    if why == OTHER_CHECKS:  # never sent as it is: what this build refuses may be in it
        return AdoptError.__name__, f"{why}, and the trainer's checkpoint {step_dir} to check again is gone"
    return "MissingStep", f"the step directory {step_dir} disappeared before the step was published"


def finished(ckpt: Path, preset: Preset) -> float | None:
    from stagerd.engine.adopt.finished import finished

    return finished(ckpt, preset)


def _layout_key(ckpt: Path) -> tuple[int, ...]:
    """What auto's choice of preset depends on: the directory's entries (its mtime) and `.metadata`'s."""
    out = [ckpt.stat().st_mtime_ns]
    for sub in (ckpt, *(d for d in (ckpt / "pytorch_model_fsdp_0", ckpt / "model") if d.is_dir())):
        try:
            st = (sub / ".metadata").stat()
            out += [st.st_mtime_ns, st.st_size]
        except FileNotFoundError:
            out.append(sub.stat().st_mtime_ns)
    return tuple(out)


def identity(ckpt: Path, preset: Preset) -> str:
    from stagerd.engine.adopt.finished import save_identity

    return save_identity(ckpt, preset)


class Adoption(Discovery):
    _adopt_clashes: set[int]
    _adopt_presets: dict[str, tuple[tuple[int, ...], Preset]]  # name -> (layout key, auto's choice)

    def _preset_of(self, ckpt: Path) -> Preset | None:
        """The checkpoint's preset (auto's choice read again only when its layout changed), or None while
        it has no DCP checkpoint a preset recognises."""
        from stagerd.engine.adopt.source import choose_preset

        name = self.settings.adopt or "auto"
        try:
            key = _layout_key(ckpt) if name == "auto" or len(LAYOUTS.get(name, ())) > 1 else ()
            cached = self._adopt_presets.get(ckpt.name)
            if cached is not None and cached[0] == key:
                return cached[1]
            preset = choose_preset(ckpt, name)
        except (OSError, StagerdError):
            return None  # no DCP checkpoint here yet, or a .metadata the export will name
        # replaced whole, never changed in place: the yield scan's threads ask too, beside the io thread
        self._adopt_presets = {**self._adopt_presets, ckpt.name: (key, preset)}
        return preset

    def _finished_at(self, ckpt: Path) -> float | None:
        """When the checkpoint was finished by its preset's rule (the mtime its journal row gets), or None
        while it is not (or no preset reads it yet). Any thread."""
        preset = self._preset_of(ckpt)
        return None if preset is None else finished(ckpt, preset)

    async def _scan(self) -> int:
        if self.settings.adopt is None:
            return await super()._scan()
        return await self._scan_adopted()

    def _relevant(self, path: str) -> bool:
        if self.settings.adopt is None:
            return super()._relevant(path)
        if f"/{layout.STATE_DIR}/" in path:
            return False  # stagerd's own exports
        name = os.path.basename(path)
        return name in COMPLETION_NAMES or parse_step_name(name) is not None

    def _find_adopted(
        self, known: dict[int, tuple[float, str | None]]
    ) -> tuple[list[Found], list[tuple[str, str]], list[Unfinished]]:
        """(step, path, mtime, identity) of every finished checkpoint whose save the journal may not have,
        the names ignored (no step, or a finished layout no preset reads), each with why, and the
        checkpoints of steps the journal lacks that are not finished yet. Read in the io thread."""
        s = self.settings
        custom = compile_step_regex(s.adopt_step)
        skip = {layout.STATE_DIR}
        out: list[Found] = []
        odd: list[tuple[str, str]] = []
        unfinished: list[Unfinished] = []
        folders: list[str] = []  # of checkpoints with no step number: the `--once` summary names them
        try:
            entries = sorted(os.scandir(self.root), key=lambda e: e.name)
        except FileNotFoundError:
            return [], [], []
        work = adopt_root(self.root, s.export_dir).resolve()
        here: set[str] = set()
        for e in entries:
            if e.name in skip or e.name.startswith("."):
                continue
            if not e.is_dir(follow_symlinks=False):
                if e.is_file(follow_symlinks=False) and parse_step_name(e.name, custom) is not None:
                    odd.append((e.name, SINGLE_FILE))  # Lightning's DDP `epoch=0-step=2.ckpt`
                continue
            if Path(e.path).resolve() == work:
                continue
            step = parse_step_name(e.name, custom)
            if step is None:
                dcp = holds_dcp(Path(e.path), custom)
                nested = None if dcp else holds_checkpoints(Path(e.path), custom)
                if nested is not None:
                    folders.append(f"{e.path} {nested}")
                said = NO_STEP_CHECKPOINT if dcp else nested or NO_STEP
                odd.append((e.name, said))  # a folder of checkpoints: warned, a folder of logs: said
                continue
            here.add(e.name)
            preset = self._preset_of(Path(e.path))
            why = unadoptable(Path(e.path)) if preset is None else None
            if why is not None:
                odd.append((e.name, why))
            mtime = None if preset is None else finished(Path(e.path), preset)
            if preset is None or mtime is None:
                if step not in known and why is None:
                    rule = NO_PRESET_RULE if preset is None else finished_rule(preset)
                    unfinished.append(Unfinished(step, e.name, rule))
                continue  # not finished (or not a DCP checkpoint): never touched
            if step in known and known[step][0] == mtime:
                out.append((step, Path(e.path), mtime, known[step][1] or ""))
                continue
            try:
                out.append((step, Path(e.path), mtime, identity(Path(e.path), preset)))
            except (OSError, StagerdError):
                continue  # gone meanwhile: the next scan sees what is there
        # a checkpoint rotated away is forgotten: the cache follows ROOT, not every checkpoint ever seen
        self._adopt_presets = {k: v for k, v in self._adopt_presets.items() if k in here}
        self._nested = folders
        return out, odd, unfinished

    def _adopted_steps_here(self) -> list[int]:
        """The step numbers the names in ROOT give now (io thread): what a scan asks the journal about."""
        custom = compile_step_regex(self.settings.adopt_step)
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return []
        return sorted({s for s in (parse_step_name(n, custom) for n in names) if s is not None})

    async def _scan_adopted(self) -> int:
        here = await self._io(self._adopted_steps_here)
        known = await self._j(self._journal.saves, here)
        rows = await self._j(lambda: {s: r for s in known if (r := self._journal.step(s)) is not None})
        found, odd, unfinished = await self._io(self._find_adopted, known)
        await self._left_unfinished(unfinished)
        self._odd_names &= {name for name, _ in odd}  # said once while there: one gone is forgotten
        for name, why in sorted(odd):
            if name not in self._odd_names:
                self._odd_names.add(name)
                level = logging.INFO if why == NO_STEP else logging.WARNING
                log.log(level, "%s %s", self.root / name, why, extra={"ignored": name})
        by_step: dict[int, list[Found]] = {}
        for f in found:
            by_step.setdefault(f[0], []).append(f)
        added = 0
        for step, same in sorted(by_step.items()):
            row = rows.get(step)
            names = sorted({p.name for _, p, _, _ in same} | ({Path(row.path).name} if row else set()))
            if len(names) > 1:
                await self._clash(step, same[0], names, row is None)
                continue
            _, path, mtime, ident = same[0]
            if row is None:
                added += await self._add_step(step, path, mtime, ident)
            elif known[step][1] in (None, ident):
                if known[step][0] != mtime:
                    await self._j(self._journal.note_save, step, mtime, ident)
            else:
                added += await self._resaved(step, path, mtime, ident, known[step][1])
        if added:
            self._wake.set()
            self._housekeep.set()
        return added

    async def _clash(self, step: int, first: Found, names: list[str], new: bool) -> None:
        if step in self._adopt_clashes:
            return
        self._adopt_clashes.add(step)
        msg = f"checkpoints {', '.join(names)} all give step {step}; none of them is exported"
        if new:
            _, path, mtime, ident = first
            await self._j(self._journal.add_step, step, path, mtime, ident)
        row = await self._j(self._journal.step, step)
        if row is not None and row.state not in (QUARANTINED, StepState.RETIRED):
            await self._j(self._journal.quarantine_step, step, AdoptError.__name__, msg)
        self._log_step(
            step, None, QUARANTINED, error_class=AdoptError.__name__, note=msg, level=logging.ERROR
        )

    def _export_adopted(
        self,
        step: int,
        step_dir: Path,
        progress: Callable[[int, int], None],
        rebuild: bool,
        rebuild_extras: bool = False,
    ) -> ExportResult:
        """Worker thread: one adopted checkpoint's export into its work directory."""
        from stagerd.daemon.hf_names import model_plan
        from stagerd.engine.adopt.export import export_adopted
        from stagerd.engine.adopt.source import AdoptOptions

        s = self.settings
        options = AdoptOptions(s.adopt or "auto", s.adopt_select, s.mapping, s.extras, model_plan)
        try:
            result = export_adopted(
                step_dir,
                self._work_dir(step_dir),
                options,
                step=step,
                progress=progress,
                rebuild=rebuild,
                rebuild_extras=rebuild_extras,
                **s.export_options(),
            )
        except AdoptError:
            if os.path.lexists(step_dir):
                raise
            # seen finished by the scan, gone before it was opened: "no preset recognises it" would
            # send the user to --adopt flags for what the trainer's rotation did
            raise AdoptError(ROTATED, path=step_dir, hint=ROTATED_HINT) from None
        names = {name for name, _ in result.files}
        if not names & {"config.json", layout.ADAPTER_WEIGHTS_NAME} and self.root not in SAID_NO_CONFIG:
            SAID_NO_CONFIG.add(self.root)
            log.warning("%s: %s", step_dir, NO_CONFIG)
        return result

    def _trainers_best(self) -> set[int]:
        """The steps a trainer names its best, kept by retention as pinned steps: with --adopt, the HF
        Trainer's among the checkpoints it wrote (deleted, the Trainer would end with the last weights and
        a warning); else those the newest steps staged by the Stager's HF Trainer callback or Lightning
        plugin name, also once the training ended. Io thread."""
        if self.settings.adopt is None:
            return staged_best(self.root)
        custom = compile_step_regex(self.settings.adopt_step)
        return adopted_best(self.root, lambda name: parse_step_name(name, custom))

    def _other_extras(self, step_dir: Path, recorded: dict[str, Any]) -> bool:
        """Io thread: an adopted export records other extras than the checkpoint's export would take now
        (config.json given with --extras DIR, or mended, since it was built): a sink that lacks the step
        gets it rebuilt. One recorded before extras were is taken as it is."""
        from stagerd.engine.adopt.extras import extras_digest
        from stagerd.engine.made_with import EXTRAS_KEY

        preset = self._preset_of(step_dir) if self.settings.adopt is not None else None
        if preset is None or EXTRAS_KEY not in recorded:
            return False
        return recorded[EXTRAS_KEY] != extras_digest(step_dir, preset, self.settings.extras)

    def _checked_otherwise(self, step_dir: Path) -> bool:
        """Io thread: the checkpoint's cached export was made by a stagerd build whose checks differ from
        this one's (`contract/adopt/checks.py`), so no sink may get it before it is exported again."""
        from stagerd.engine.made_with import recorded_options

        if self.settings.adopt is None:
            return False
        return not made_by_these_checks(recorded_options(self._work_dir(step_dir)))

    def _adopted_identity(self, step_dir: Path) -> str | None:
        preset = self._preset_of(step_dir)
        if preset is None or finished(step_dir, preset) is None:
            return None
        try:
            return identity(step_dir, preset)
        except (OSError, StagerdError):
            return None
