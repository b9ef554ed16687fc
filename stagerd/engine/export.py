"""Export one staged step: marker -> checked shards -> `export.tmp/` -> atomic rename to `export/`.

Safe to call again after a crash at any point: a stale `export.tmp/` is rebuilt, and `export/` exists only
once it is complete.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from stagerd.contract import commit_marker, layout
from stagerd.contract.adopt.checks import CHECKS_KEY, made_by_these_checks
from stagerd.contract.export_tree import regular_files
from stagerd.contract.hub_plan import HubPlan
from stagerd.contract.json_fields import loads
from stagerd.contract.key_mapping import KeyMapping
from stagerd.contract.progress_fn import ProgressFn
from stagerd.contract.regular_file import linked
from stagerd.contract.sharding import DEFAULT_MAX_SHARD_SIZE
from stagerd.contract.step.held import HINT, WHY, HeldDir
from stagerd.engine.adapter import build_adapter
from stagerd.engine.consolidate import consolidate_into
from stagerd.engine.execute import output_error
from stagerd.engine.export_map import read_weight_map
from stagerd.engine.hub_config import CONFIG_NAME, exported_config
from stagerd.engine.made_with import EXTRAS_KEY, changed_options, changed_text, recorded_options
from stagerd.engine.merge import MERGE_SCRATCH_PREFIX
from stagerd.engine.parsed_extras import PARSED_EXTRAS, read_json_object
from stagerd.engine.source import Source, held_source
from stagerd.errors import (
    ExportMismatchError,
    HubPlanError,
    OutputError,
    StagerdError,
)
from stagerd.ops.crashpoints import crash_point

log = logging.getLogger("stagerd.export")


@dataclass(frozen=True)
class ExportResult:
    """What an export holds. `files` are (relative name, size) of every file: shards, index, extras."""

    export_dir: Path
    files: tuple[tuple[str, int], ...]
    tensor_bytes: int
    tensors: int
    seconds: float
    skipped: bool
    own_bytes: int | None = None  # of a fleet step, the bytes this node built (`files` is the whole export)


def build_export(
    source: Source,
    tmp: Path,
    *,
    dtype: str | None,
    keep_dtype: str | None,
    reference: Mapping[str, str] | None,
    max_shard_size: int,
    threads: int,
    progress: ProgressFn | None,
    views: HubPlan | None = None,
    scratch_parent: Path | None = None,
) -> ExportResult:
    """Consolidate `source` and copy its extras into the empty directory `tmp`, everything fsynced.
    `views`: the to-Hub plan; default the marker's. `scratch_parent`: where a LoRA merge's scratch goes,
    default beside `tmp`.

    The result describes `tmp` as written, from the plan and the copies, so no caller re-reads it.
    """
    t0 = time.monotonic()
    for rel in source.extras():  # before any byte is written
        if rel in PARSED_EXTRAS:
            read_json_object(source.extra_path(rel), named=source.extra_name(rel))
    res = consolidate_into(
        source.model_dir,
        tmp,
        listed=source.listed,
        dtype=dtype,
        keep_dtype=keep_dtype,
        reference=reference,
        max_shard_size=max_shard_size,
        expected=source.expected(),
        views=views if views is not None else source.views(),
        threads=threads,
        progress=progress,
        scan=source.scan,
        scratch_parent=scratch_parent,
    )
    files = [*res.files, *([res.index] if res.index else [])]
    if source.marker is not None and source.marker.adapter_plan is not None:
        files.append(build_adapter(source, tmp, source.marker.adapter_plan, dtype, keep_dtype, threads))
    for rel in source.extras():
        if not layout.exported_extra(rel):
            continue
        crash_point("export.extra")
        dst = tmp / rel
        staged = source.extra_path(rel)
        try:
            dst.parent.mkdir(parents=True, exist_ok=True)
            config = None
            if rel == CONFIG_NAME:
                config = exported_config(staged, dict(res.dtype_bytes), dtype, res.named_dtype)
            if config is None:
                shutil.copyfile(staged, dst)
            else:  # names the dtype the files hold; the staged original is only read
                dst.write_bytes(config)
            fd = os.open(dst, os.O_RDONLY)
            try:
                os.fsync(fd)
                files.append((rel, os.fstat(fd).st_size))
            finally:
                os.close(fd)
        except OSError as e:
            raise OutputError(f"cannot copy extra {rel!r}: {e.strerror}", path=dst) from None
    layout.fsync_dir(tmp)
    return ExportResult(
        tmp, tuple(sorted(files)), res.total_size, res.tensors, time.monotonic() - t0, skipped=False
    )


def list_files(d: Path) -> tuple[tuple[str, int], ...]:
    return regular_files(d)


def _existing(d: Path) -> ExportResult:
    """What an export finished earlier holds, read back from its index or its one file (nothing was
    planned this time)."""
    weight_map, total_size = read_weight_map(d)
    return ExportResult(d, list_files(d), total_size, len(weight_map), 0.0, True)


def mapped_plan(marker: commit_marker.CommitMarker, mapping: Path, step_dir: Path) -> tuple[HubPlan, str]:
    """The plan of `mapping` for this step's tensors, and the sha256 of the mapping file (an option)."""
    if marker.tensors is None:
        raise HubPlanError(
            "--mapping needs the tensors' shapes, and this commit marker does not list them",
            path=step_dir / layout.MARKER_NAME,
            hint="save through the Stager, which records them, or give the Stager the mapping",
        )
    try:
        raw = Path(mapping).read_bytes()
    except OSError as e:
        raise HubPlanError(f"cannot read the key mapping: {e.strerror}", path=mapping) from None
    try:
        spec = loads(raw)
    except ValueError as e:
        raise HubPlanError(f"the key mapping is not JSON: {e}", path=mapping) from None
    plan = KeyMapping.load(spec, source=mapping).resolve({k: v.shape for k, v in marker.tensors.items()})
    return plan, hashlib.sha256(raw).hexdigest()


def export_step(
    step_dir: Path,
    *,
    dtype: str | None = None,
    keep_dtype: str | None = None,
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
    threads: int = 2,
    progress: ProgressFn | None = None,
    rebuild: bool = True,
    mapping: Path | None = None,
    default_shard_size: bool = False,
) -> ExportResult:
    """Export a committed step into `<step_dir>/export/`; a no-op (`skipped`) if that already exists.

    `dtype` None means the marker's hint, or keep; an explicit value overrides the hint. The options an
    export was made with are kept beside it: asked for others, it is rebuilt, or with `rebuild` False (a
    sink already holds the old one) an ExportMismatchError, before anything is touched. `mapping`: a key
    mapping file (`contract/key_mapping.py`) for a step whose marker has no to-Hub plan of its own (the
    trainer's plan wins); its content is one of the recorded options. `default_shard_size`: the size is
    the default, not the user's: an export a sink holds keeps the size it was made with (an upgrade may
    change the default).
    """
    t0 = time.monotonic()
    step_dir = Path(step_dir)
    # Read through the held directory: a link put at its path later leads nothing read elsewhere.
    try:
        held = HeldDir.open(step_dir)
    except (FileNotFoundError, NotADirectoryError):
        from stagerd.errors import MarkerError

        raise MarkerError(
            "no commit marker: the step is not committed", path=step_dir / layout.MARKER_NAME
        ) from None
    with held, held.naming(), held_source(held) as source:
        return _export_opened(
            source,
            step_dir,
            t0,
            dtype=dtype,
            keep_dtype=keep_dtype,
            max_shard_size=max_shard_size,
            threads=threads,
            progress=progress,
            rebuild=rebuild,
            mapping=mapping,
            default_shard_size=default_shard_size,
        )


def _export_opened(
    source: Source,
    step_dir: Path,
    t0: float,
    *,
    dtype: str | None,
    keep_dtype: str | None,
    max_shard_size: int,
    threads: int,
    progress: ProgressFn | None,
    rebuild: bool,
    mapping: Path | None,
    default_shard_size: bool,
) -> ExportResult:
    if source.marker is None:
        from stagerd.errors import MarkerError

        raise MarkerError("no commit marker: the step is not committed", path=step_dir / layout.MARKER_NAME)
    options: dict[str, Any] = {}
    views = source.marker.hub_plan
    if mapping is not None and views is None:
        views, options["mapping"] = mapped_plan(source.marker, mapping, step_dir)
    built = export_source(
        source,
        step_dir,
        options,
        step=source.marker.step,
        dtype=source.target_dtype(dtype),
        keep_dtype=keep_dtype,
        max_shard_size=max_shard_size,
        threads=threads,
        progress=progress,
        rebuild=rebuild,
        views=views,
        default_shard_size=default_shard_size,
    )
    return built if built.skipped else replace(built, seconds=time.monotonic() - t0)


def export_source(
    source: Source,
    work_dir: Path,
    options: Mapping[str, Any],
    *,
    step: int,
    dtype: str | None,
    keep_dtype: str | None,
    max_shard_size: int,
    threads: int,
    progress: ProgressFn | None,
    rebuild: bool,
    views: HubPlan | None,
    before_commit: Callable[[], None] | None = None,
    default_shard_size: bool = False,
    rebuild_extras: bool = False,
) -> ExportResult:
    """Export `source` into `<work_dir>/export/` (built in `export.tmp/`, renamed when whole), with its
    options (`dtype`, `keep_dtype`, `max_shard_size`, then the source's own `options`) recorded beside it;
    a no-op (`skipped`) when an export with those options is there. `dtype` is the target (None: keep).
    `before_commit` runs after the files are durable and before the rename (an adopted checkpoint checks
    that its source did not change meanwhile). `default_shard_size`: as in `export_step`.
    `rebuild_extras`: one whose extras alone changed is rebuilt even where `rebuild` is not given."""
    wanted = {"dtype": dtype or "keep", "keep_dtype": keep_dtype, "max_shard_size": max_shard_size, **options}
    final = work_dir / layout.EXPORT_DIR
    recorded = recorded_options(work_dir)
    if recorded is not None and default_shard_size and not rebuild:
        # the sinks' copies were cut at the recorded size; a rebuild for another sink must match them
        max_shard_size = wanted["max_shard_size"] = recorded.get("max_shard_size", max_shard_size)
    # made under other checks (an adopted export: `contract/adopt/checks.py`): rebuilt even where a sink
    # holds it, as the same options make the same bytes; what this build refuses is refused then
    recheck = CHECKS_KEY in wanted and not made_by_these_checks(recorded)
    changed = {} if recorded is None else changed_options(recorded, wanted)
    if recorded is not None and changed:
        if not (rebuild or (rebuild_extras and changed.keys() == {EXTRAS_KEY})):
            raise ExportMismatchError(
                f"step {step} was exported with other options ({changed_text(recorded, changed)}) and a "
                "sink holds that export",
                path=work_dir / layout.EXPORT_OPTIONS_NAME,
            )
    elif layout.export_is_whole(final) and not recheck:
        return _existing(final)
    reference = source.reference()
    tmp = work_dir / layout.EXPORT_TMP_DIR
    # Every write and delete below is made from held handles of work_dir and export.tmp/: a link put at
    # either path meanwhile leads none of them elsewhere, and is refused before anything is committed.
    try:
        held = HeldDir.open(work_dir)
    except OSError as e:
        raise OutputError(f"cannot prepare the export directory: {e.strerror}", path=tmp) from None
    why = "made by a stagerd build whose checks differ" if recheck else None
    with held, held.naming(), _prepared(held, tmp, final, recorded, why) as out, out.naming():
        built = build_export(
            source,
            out.proc,
            dtype=dtype,
            keep_dtype=keep_dtype,
            reference=reference,
            max_shard_size=max_shard_size,
            threads=threads,
            progress=progress,
            views=views,
            scratch_parent=held.proc,
        )
        if before_commit is not None:
            before_commit()
        _commit(held, out, wanted)
    return replace(built, export_dir=final)


@contextlib.contextmanager
def _prepared(
    held: HeldDir, tmp: Path, final: Path, recorded: object, why: str | None = None
) -> Iterator[HeldDir]:
    """A new, empty export.tmp/ in `held`, held open (a stale one, a killed merge's scratch and an export
    to rebuild, for `why` or its options, removed first); removed again if the export fails."""
    try:
        if held.lexists(layout.EXPORT_TMP_DIR):
            log.info("removing a stale %s from an interrupted export", tmp)
            held.rmtree(layout.EXPORT_TMP_DIR)
        for name in held.names():
            if name.startswith(MERGE_SCRATCH_PREFIX):
                log.info("removing %s, a LoRA merge's scratch left by a killed export", held.path / name)
                held.rmtree(name)
        if held.lexists(layout.EXPORT_DIR):
            # Only stagerd writes export/, always by rename; without its weights it is not ours to trust,
            # and one made with other options than these is rebuilt (no sink holds it: see `rebuild`).
            whole = layout.export_is_whole(held.proc / layout.EXPORT_DIR)
            why = (why or "made with other options") if whole else "it has no weights"
            log.warning("removing %s: %s (%s); exporting again", final, why, recorded)
            held.rmtree(layout.EXPORT_DIR)
        held.mkdir(layout.EXPORT_TMP_DIR)
        out = held.child(layout.EXPORT_TMP_DIR)
    except OSError as e:
        raise OutputError(f"cannot prepare the export directory: {e.strerror}", path=tmp) from None
    with out:
        try:
            yield out
        except BaseException:
            with contextlib.suppress(OSError):
                if held.holds(layout.EXPORT_TMP_DIR, out):
                    held.rmtree(layout.EXPORT_TMP_DIR)
                elif not held.holds(layout.EXPORT_DIR, out):  # moved away, a link put in its place:
                    out.clear()  # empty what we wrote, wherever it now is (never an export committed)
            raise


def _commit(held: HeldDir, out: HeldDir, wanted: Mapping[str, Any]) -> None:
    """Record the options and rename export.tmp/ to export/, only while both are still where they were."""
    if held.replaced():
        raise _moved(held.path, "the step directory")
    if not held.holds(layout.EXPORT_TMP_DIR, out):
        raise _moved(out.path, "the export being built")
    options_path = held.proc / layout.EXPORT_OPTIONS_NAME
    try:
        layout.write_json_atomic(options_path, wanted)
    except OSError as e:
        raise output_error(e, options_path) from None
    held.rename(layout.EXPORT_TMP_DIR, layout.EXPORT_DIR)
    held.fsync()
    crash_point("export.renamed")


def _moved(path: Path, what: str) -> StagerdError:
    if os.path.islink(path):
        return linked(path, WHY, HINT)
    return OutputError(
        f"{what} was moved or replaced while it was exported; nothing was committed",
        path=path,
        hint="leave the step directory in place until it is exported, then retry",
    )
