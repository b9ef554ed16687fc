"""`stagerd consolidate SRC OUT`: turn one step's DCP shards into a Hugging Face safetensors model."""

from __future__ import annotations

import argparse
import os
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from stagerd.cmd.flag_types import export_dtype
from stagerd.cmd.help import UserHelpFormatter
from stagerd.contract.dtypes import EXPORT_DTYPE_TEXT
from stagerd.errors import ConfigError, OutputError, ShardError

if TYPE_CHECKING:
    from stagerd.engine.source import Source

EXAMPLES = """examples:
  stagerd consolidate /scratch/run1/step-00001000 ./hf-1000
  stagerd consolidate run1/step-00001000 ./hf --dtype bf16 --max-shard-size 2GB
  stagerd consolidate ./shards ./hf --reference-index base/index.json
  stagerd consolidate ckpts/step-300 ./hf-300 --adopt torchtitan --extras assets
"""


def threads_default() -> int:
    return max(1, min(4, os.cpu_count() or 1))


def check_threads(threads: int) -> None:
    """The daemon's bound on its copy threads (`export_threads`): the copies and reads are I/O-bound, so
    past a few dozen threads they only contend for the same disks, and a mistyped 100000 would start that
    many threads."""
    from stagerd.config import MAX_WORKERS

    if not 1 <= threads <= MAX_WORKERS:
        raise ConfigError(f"--threads must be between 1 and {MAX_WORKERS}, got {threads}")


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser], name: str) -> None:
    p = sub.add_parser(
        name,
        help="turn a step's DCP shards into HF safetensors, as save_pretrained writes them",
        description=(
            "Write SRC's weights to OUT as save_pretrained does (model.safetensors, or numbered files and "
            "their index when over --max-shard-size), plus the step's "
            "extras (config.json, tokenizer...). OUT appears only when it is complete; SRC is never changed. "
            "Exit 0 on success, 2 on bad input (a damaged step, a used OUT), 3 when retrying may help "
            "(a full disk)."
        ),
        epilog=EXAMPLES,
        formatter_class=UserHelpFormatter,
    )
    p.add_argument("src", type=Path, metavar="SRC", help="step directory, or a directory of DCP HF shards")
    p.add_argument(
        "out",
        type=Path,
        metavar="OUT",
        help="new output directory: it must not exist or be empty, and must be outside SRC",
    )
    p.add_argument(
        "--dtype",
        type=export_dtype,
        metavar="DTYPE",
        help=f"{EXPORT_DTYPE_TEXT}: cast floating tensors (default: the marker's hint, else keep)",
    )
    p.add_argument("--keep-dtype", metavar="REGEX", help="tensor names matching REGEX are never cast")
    p.add_argument(
        "--reference-index", type=Path, metavar="FILE", help="group tensors into files as this index does"
    )
    p.add_argument(
        "--max-shard-size",
        default="50GB",
        help="largest output file (default 50GB, as save_pretrained: one model.safetensors when it fits)",
    )
    p.add_argument("--threads", type=int, default=threads_default(), metavar="N", help="copy threads")
    add_adopt_flags(p)
    p.set_defaults(func=run)


def add_adopt_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--adopt",
        nargs="?",
        const="auto",
        metavar="PRESET",
        help="SRC is a trainer's own checkpoint: auto, hf-trainer, accelerate, automodel, lightning, "
        "torchtitan, dcp, hf",
    )
    p.add_argument("--adopt-select", metavar="REGEX", help="adopt: the tensor keys that are the model")
    p.add_argument("--mapping", type=Path, metavar="FILE", help="adopt: key mapping (JSON) after selection")
    p.add_argument("--extras", type=Path, metavar="DIR", help="adopt: config.json and tokenizer to ship")


def adopted_source(args: argparse.Namespace, src: Path) -> Source | None:
    """The adopted checkpoint `src` when --adopt is given, else None (a Stager step or shard directory)."""
    if args.adopt is None:
        for flag in ("adopt_select", "mapping", "extras"):
            if getattr(args, flag) is not None:
                raise ConfigError(f"--{flag.replace('_', '-')} needs --adopt")
        return None
    from stagerd.contract.adopt.presets import get_preset
    from stagerd.daemon.hf_names import model_plan
    from stagerd.engine.adopt.source import AdoptOptions, open_adopted

    if args.adopt != "auto":
        get_preset(args.adopt)
    # the names `watch --adopt` exports under: what verify compares with, what consolidate writes
    options = AdoptOptions(args.adopt, args.adopt_select, args.mapping, args.extras, model_plan)
    return open_adopted(src, options, dtype=getattr(args, "dtype", None))


def _is_adapter(source: Source) -> bool:
    """An adopted PEFT adapter alone: its one file is named as PEFT names it."""
    from stagerd.engine.adopt.source import AdoptedSource

    return isinstance(source, AdoptedSource) and source.preset.adapter


def check_out(src: Path, model_dir: Path, out: Path) -> None:
    """OUT must be a new or empty directory outside SRC: writing into the step would mix the export with
    the shards it is read from, and retention deletes the step with everything in it. Nor may it be a link
    (OUT is replaced by one rename, which would not follow it), a mount point, or lie in another step."""
    from stagerd.cmd.staging_places import refuse_a_mount_point, refuse_staging_area

    if out.is_symlink():
        from stagerd.errors import SymlinkError

        raise SymlinkError(
            f"OUT is a symbolic link (-> {os.readlink(out)}); consolidate never writes via links",
            path=out,
            hint=f"give the real path ({os.path.realpath(out)}), or remove the link; nothing was changed",
        )
    if out.exists() and not out.is_dir():
        raise ConfigError("OUT exists and is a file", path=out, hint="choose a new OUT directory")
    _refuse_a_file_above(out)
    out_r, src_r, model_r = out.resolve(), src.resolve(), model_dir.resolve()
    for inside in (src_r, model_r):
        if out_r == inside or inside in out_r.parents:
            raise ConfigError(
                f"OUT is inside the source {inside}",
                path=out,
                hint="choose an OUT outside the step directory, e.g. next to it",
            )
    if out.is_dir() and any(out.iterdir()):
        raise ConfigError("OUT exists and is not empty", path=out, hint="choose a new OUT or empty it first")
    refuse_a_mount_point(out, "OUT")
    refuse_staging_area(out, "OUT")


def _refuse_a_file_above(out: Path) -> None:
    """A file where a directory above OUT must be: making OUT fails with "File exists" or "Not a
    directory", which reads as a full disk, and no retry helps."""
    from stagerd.contract.layout import nearest_existing

    parent = nearest_existing(Path(os.path.abspath(out)).parent)
    if not parent.is_dir():
        raise ConfigError(
            f"a parent of OUT, {parent}, is a file, not a directory",
            path=out,
            hint="choose an OUT whose parent is a directory (or can be made); nothing was written",
        )


def _prepare_out(out: Path) -> Path:
    """A temp sibling of OUT to build in; OUT itself appears only complete, by rename."""
    tmp = out.parent / f".{out.name}.stagerd-tmp-{os.getpid()}"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    except OSError as e:
        raise OutputError(f"cannot create the output directory: {e.strerror}", path=out) from None
    return tmp


def warn_uncommitted(src: Path) -> None:
    """A step directory without its marker is a save still being written, or one that failed: its shards
    are read as they are, which the daemon never does; say so rather than pass a torn step for a step."""
    import logging

    from stagerd.contract import layout

    if layout.parse_step_dir(src.resolve().name) is not None and not (src / layout.MARKER_NAME).exists():
        logging.getLogger("stagerd").warning(
            "%s has no %s: the step is not committed (a save still being written, or one that failed); its "
            "shards are read as they are now. Wait for the save (stager.wait()) to export a whole step",
            src,
            layout.MARKER_NAME,
        )


def refuse_a_root(src: Path, what: str) -> None:
    """A staging ROOT given where a step is meant reads as a step with no shards, whose hint (re-save it, or
    delete it) would be wrong and dangerous: name the ROOT and its newest step instead."""
    from stagerd.contract import layout

    if not src.is_dir() or (src / layout.MARKER_NAME).exists():
        return
    steps = sorted(n for n in os.listdir(src) if layout.parse_step_dir(n) is not None and (src / n).is_dir())
    if steps or (src / layout.STATE_DIR).is_dir():
        example = src / (steps[-1] if steps else layout.step_dir_name(100))
        raise ConfigError(
            f"{what} is a staging ROOT, not a step: give one of its step directories",
            path=src,
            hint=f"e.g. {example}",
        )


def refuse_an_hf_checkpoint(src: Path, what: str, hint: str) -> None:
    """A directory of Hugging Face weights (a trainer's checkpoint, or an export) read as a staged step
    fails on its file names with the hint of a damaged step (re-save it, or delete it), which would send
    the user to delete their checkpoint: name what it is instead."""
    from stagerd.contract.layout import INDEX_NAME, MARKER_NAME, WEIGHTS_NAME

    if (src / MARKER_NAME).exists():
        return
    if any((src / n).is_file() for n in (WEIGHTS_NAME, INDEX_NAME)):
        raise ConfigError(
            f"{what} is already a Hugging Face export or checkpoint (a trainer's), not a staged step",
            path=src,
            hint=hint,
        )


@contextmanager
def unstaged_hint(src: Path, what: str, *, adopted: bool) -> Iterator[None]:
    """A staged step's damage says re-save it, or delete it; a directory without a commit marker was not
    written by a Stager save (a trainer's checkpoint, a save not yet committed), and stagerd never tells a
    user to delete what it did not write."""
    from stagerd.contract.layout import MARKER_NAME

    try:
        yield
    except ShardError as e:
        within = e.path is not None and Path(os.path.abspath(e.path)).is_relative_to(os.path.abspath(src))
        if e.hint != ShardError.hint or not within:  # another hint, or of another directory (the export)
            raise
        if adopted:
            e.hint = (
                f"{what} is not a whole checkpoint as --adopt reads it: check that the trainer finished "
                "saving it (and the preset, --adopt PRESET). Nothing was changed"
            )
        elif not (src / MARKER_NAME).exists():
            e.hint = (
                f"{what} has no {MARKER_NAME}, so no Stager save committed it: a trainer's own checkpoint "
                "is read with --adopt; a Stager save is read once committed (stager.wait()). Nothing was "
                "changed"
            )
        raise


def run(args: argparse.Namespace) -> int:
    from stagerd.contract.sharding import parse_size
    from stagerd.engine.source import open_source

    t0 = time.monotonic()
    try:
        max_size = parse_size(args.max_shard_size)
    except ValueError as e:
        raise ConfigError(f"--max-shard-size: {e}") from None
    check_threads(args.threads)
    if not args.src.exists():
        raise ConfigError("SRC does not exist", path=args.src, hint="check the path of the step directory")
    if not args.src.is_dir():
        raise ConfigError(
            "SRC is a file, not a directory", path=args.src, hint="give the step's directory (ROOT/step-N)"
        )
    if args.adopt is None:
        refuse_a_root(args.src, "SRC")
        warn_uncommitted(args.src)
        refuse_an_hf_checkpoint(
            args.src,
            "SRC",
            f"check it with `stagerd verify {args.src}`, or re-shard or cast it with --adopt hf",
        )
    with unstaged_hint(args.src, "SRC", adopted=args.adopt is not None):
        return _consolidate(args, adopted_source(args, args.src) or open_source(args.src), max_size, t0)


def _consolidate(args: argparse.Namespace, source: Source, max_size: int, t0: float) -> int:
    from stagerd.contract.layout import fsync_dir
    from stagerd.contract.reference_index import read_reference_index
    from stagerd.engine.export import build_export, list_files
    from stagerd.ops.progress import progress

    check_out(args.src, source.model_dir, args.out)
    dtype = source.target_dtype(args.dtype)
    adapter = _is_adapter(source)
    if adapter:  # one file, as PEFT writes it
        from stagerd.engine.adapter import ADAPTER_MAX_SHARD_SIZE

        max_size = ADAPTER_MAX_SHARD_SIZE
    reference = read_reference_index(args.reference_index) if args.reference_index else source.reference()
    tmp = _prepare_out(args.out)
    try:
        with progress(f"consolidate {args.src.name}", 0) as bar:
            build_export(
                source,
                tmp,
                dtype=dtype,
                keep_dtype=args.keep_dtype,
                reference=reference,
                max_shard_size=max_size,
                threads=args.threads,
                progress=bar,
                views=source.views(),
            )
        if adapter:
            from stagerd.engine.adopt.export import name_adapter

            name_adapter(tmp)
        if args.out.exists():
            args.out.rmdir()
        os.rename(tmp, args.out)
        fsync_dir(args.out.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    files = list_files(args.out)
    total = sum(s for _, s in files)
    secs = time.monotonic() - t0
    from stagerd.cmd.status_table import size

    rate = size(total / max(secs, 1e-9))
    print(f"wrote {len(files)} files, {size(total)}, to {args.out} in {secs:.2f} s ({rate}/s)")
    return 0
