"""Export one adopted checkpoint into a work directory outside it, and prove its source held still.

The export is the one every step gets (`export.export_source`: the plan, `export.tmp/`, fsync, options
recorded, rename to `export/`). Around it, the files it reads are watched: their size, mtime, inode and
device before and after, and `.metadata`'s bytes, and no data file may be newer than `.metadata` (DCP
writes the data first, so a newer one is the next save overwriting this checkpoint in place). Any
difference, or a file gone, is a `SourceChangedError` before the rename: nothing of it is published.
The checkpoint is read through its directory held open (`contract/step/held.py`), and its model directory
and data files through handles held from it (`source.py`): swapped for a link to another save of the same
shapes while it is read, and put back before that check, any of them led the reads there. One of them no
longer at its name at the check (moved, deleted, a link left there) is a `SourceChangedError` too.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import replace
from pathlib import Path

from stagerd.contract import layout
from stagerd.contract.adopt.checks import CHECKS, CHECKS_KEY
from stagerd.contract.layout import ADAPTER_WEIGHTS_NAME
from stagerd.contract.progress_fn import ProgressFn
from stagerd.contract.sharding import DEFAULT_MAX_SHARD_SIZE
from stagerd.contract.step.held import HeldDir, HeldFiles
from stagerd.engine.adapter import ADAPTER_MAX_SHARD_SIZE
from stagerd.engine.adopt.extras import extras_digest
from stagerd.engine.adopt.finished import save_identity
from stagerd.engine.adopt.source import AdoptedSource, AdoptOptions, open_adopted
from stagerd.engine.export import ExportResult, export_source
from stagerd.engine.made_with import EXTRAS_KEY
from stagerd.errors import OutputError, ShardError, SourceChangedError, StagerdError
from stagerd.ops.crashpoints import delay_point

Snapshot = dict[str, tuple[int, int, int, int]]
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC


def snapshot(source: AdoptedSource, *, first: bool = True) -> Snapshot:
    """(size, mtime_ns, inode, device) of every file the export reads, and of the completion files. A file
    missing at the `first` look is a ShardError (the checkpoint lacks it); later, a SourceChangedError."""
    out: Snapshot = {}
    paths = [*source.read_files(), *(source.step_dir / f for f in source.preset.completion_files())]  # type: ignore[operator]
    for p in paths:
        try:
            st = os.stat(p)
        except FileNotFoundError:
            if first:
                raise ShardError("a file of the finished checkpoint is missing", path=p) from None
            raise SourceChangedError("disappeared while the checkpoint was read", path=p) from None
        out[str(p)] = (st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev)
    meta = out.get(str(source.model_dir / ".metadata"))
    newer = [p for p in out if meta is not None and p.endswith(".distcp") and out[p][1] > meta[1]]
    if newer:
        raise SourceChangedError(
            f"{Path(newer[0]).name} is newer than .metadata: the trainer is saving into it again",
            path=source.step_dir,
        )
    return out


def check_unchanged(source: AdoptedSource, before: Snapshot, held: HeldDir | None = None) -> None:
    """The files `before` describes are still those, and `.metadata` is still the one the plan read; the
    checkpoint's path still names the directory `held` (a save renamed into its place is the next one)."""
    if held is not None and held.replaced():
        raise SourceChangedError("was moved, deleted or replaced while it was exported", path=held.path)
    moved = None if source.files is None else source.files.replaced()
    if moved is not None:  # the model's directory or a data file (a link swapped in stays unread)
        raise SourceChangedError("was moved, deleted or replaced while it was exported", path=moved)
    after = snapshot(source, first=False)
    for p, st in before.items():
        if after.get(p) != st:
            raise SourceChangedError("changed while it was exported", path=p)
    try:
        now = save_identity(source.step_dir, source.preset)  # type: ignore[arg-type]
    except (OSError, StagerdError):
        raise SourceChangedError("disappeared while it was exported", path=source.model_dir) from None
    if now != source.identity:
        raise SourceChangedError("was saved again while it was exported", path=source.model_dir)


def export_adopted(
    ckpt: Path,
    work_dir: Path,
    options: AdoptOptions | None = None,
    *,
    step: int = 0,
    dtype: str | None = None,
    keep_dtype: str | None = None,
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
    threads: int = 2,
    progress: ProgressFn | None = None,
    rebuild: bool = True,
    rebuild_extras: bool = False,
    default_shard_size: bool = False,
) -> ExportResult:
    """Export the finished checkpoint `ckpt` into `<work_dir>/export/` (created as needed; never inside
    `ckpt`). A no-op (`skipped`) when an export of this save with these options is there.
    `default_shard_size`: as in `export_step`. `rebuild_extras`: an export whose extras alone changed
    (config.json given since) may be rebuilt though a sink holds it: its weights are the same bytes."""
    ckpt, work_dir = Path(ckpt), Path(work_dir)
    real, inside = ckpt.resolve(), work_dir.resolve()
    if inside == real or real in inside.parents:
        raise StagerdError(f"the export directory {work_dir} is inside the checkpoint", path=ckpt)
    options = options or AdoptOptions()
    delay_point("adopt.open")
    try:
        held = HeldDir.open(ckpt)
    except (FileNotFoundError, NotADirectoryError):
        open_adopted(ckpt, options)  # names what is not there, as it always did
        raise
    # The parent (ROOT, whose path the operator gave) followed to its directory, the extras in it not.
    with (
        held,
        HeldDir(ckpt.parent, os.open(ckpt.parent, _DIR_FLAGS)) as parent,
        held.naming(),
        HeldFiles() as files,
        files.naming(),
    ):
        source = open_adopted(held.proc, options, parent=parent, held=(held, files), dtype=dtype)
        before = snapshot(source)
        recorded = {
            "source": source.identity,
            "preset": source.preset.name,
            "select": options.select,
            "mapping": None if options.mapping is None else _sha256(options.mapping),
            EXTRAS_KEY: extras_digest(ckpt, source.preset, options.extras),
            CHECKS_KEY: CHECKS,
        }
        work_dir.mkdir(parents=True, exist_ok=True)
        adapter = source.preset.adapter
        if adapter:  # one file, as PEFT writes it, whatever its size
            max_shard_size, default_shard_size = ADAPTER_MAX_SHARD_SIZE, False

        def commit_check() -> None:
            delay_point("adopt.built")
            check_unchanged(source, before, held)
            if adapter:
                name_adapter(work_dir / layout.EXPORT_TMP_DIR)

        try:
            built = export_source(
                source,
                work_dir,
                recorded,
                step=step,
                dtype=source.target_dtype(dtype),
                keep_dtype=keep_dtype,
                max_shard_size=max_shard_size,
                threads=threads,
                progress=progress,
                rebuild=rebuild,
                rebuild_extras=rebuild_extras,
                views=source.plan,
                before_commit=commit_check,
                default_shard_size=default_shard_size,
            )
        except SourceChangedError:
            raise
        except (StagerdError, OSError):
            check_unchanged(source, before, held)  # a read failed: the trainer deleted the checkpoint?
            raise
    if not adapter or built.skipped:
        return built
    named = ((ADAPTER_WEIGHTS_NAME if rel == layout.WEIGHTS_NAME else rel, size) for rel, size in built.files)
    return replace(built, files=tuple(sorted(named)))


def name_adapter(tmp: Path) -> None:
    """The adapter's one file under PEFT's name (`PeftModel.from_pretrained` reads no other), before the
    export is committed."""
    try:
        os.rename(tmp / layout.WEIGHTS_NAME, tmp / ADAPTER_WEIGHTS_NAME)
        layout.fsync_dir(tmp)
    except OSError as e:
        raise OutputError(f"cannot name the adapter's file: {e.strerror}", path=tmp) from None


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()
