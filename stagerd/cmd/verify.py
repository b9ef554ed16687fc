"""`stagerd verify EXPORT_DIR [--against SRC]`: prove an export is complete and, optionally, exact."""

from __future__ import annotations

import argparse
import os
from contextlib import nullcontext
from pathlib import Path

from stagerd.cmd.consolidate import (
    add_adopt_flags,
    adopted_source,
    check_threads,
    refuse_a_root,
    refuse_an_hf_checkpoint,
    threads_default,
    unstaged_hint,
    warn_uncommitted,
)
from stagerd.cmd.help import UserHelpFormatter
from stagerd.contract import layout
from stagerd.errors import ConfigError, MarkerError, VerifyError

EXAMPLES = """examples:
  stagerd verify ./hf-1000
  stagerd verify ./hf-1000 --against /scratch/run1/step-00001000
  stagerd verify ./hf-300 --against outputs/checkpoint-300 --adopt
"""


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser], name: str) -> None:
    p = sub.add_parser(
        name,
        help="check an export: its index, every file header, and (with --against) every byte",
        description=(
            "Re-read EXPORT_DIR and check that its index and safetensors files agree and are complete; a "
            "published copy's stagerd.manifest.json is checked too (each file's size and sha256). "
            "With --against, also compare every tensor with the step it was made from. Exit 0 when the "
            "export is good, 2 when it is not (the message names the file)."
        ),
        epilog=EXAMPLES,
        formatter_class=UserHelpFormatter,
    )
    # Strings, not Paths: a URL given here is named as one, before Path folds its `//`.
    p.add_argument("export_dir", metavar="EXPORT_DIR", help="the directory `consolidate` wrote")
    p.add_argument("--against", metavar="SRC", help="step, shard or (--adopt) checkpoint directory")
    p.add_argument("--threads", type=int, default=threads_default(), metavar="N", help="read threads")
    add_adopt_flags(p)
    p.set_defaults(func=run)


_DAMAGED = (
    "this copy differs from what was published: fetch it again (`stagerd restore URL OUT --export --step N`)"
)


def check_manifest(export_dir: Path) -> int:
    """A published copy (a sink's step directory, or one downloaded from it) carries the manifest the
    publisher wrote: check every listed file's size and sha256, which the headers and index alone cannot
    (a flipped byte inside a tensor passes them). The number of files checked; 0 without a manifest."""
    import hashlib

    from stagerd.contract.manifest import MAX_MANIFEST_BYTES, read_manifest
    from stagerd.contract.regular_file import read_regular

    path = export_dir / layout.MANIFEST_NAME
    if not path.is_file():
        return 0
    try:
        # as a sink reads it: never more than its limit in memory
        manifest = read_manifest(read_regular(path, MAX_MANIFEST_BYTES + 1), path)
    except OSError as e:
        raise VerifyError(f"cannot read the manifest: {e.strerror}", path=path, hint=_DAMAGED) from None
    except MarkerError as e:
        raise VerifyError(f"cannot read the manifest: it {e.message}", path=path, hint=_DAMAGED) from None
    for f in manifest.files:
        file = export_dir / f.path
        if not file.is_file() or file.stat().st_size != f.size:
            raise VerifyError(
                f"missing or not {f.size} bytes, as the manifest lists", path=file, hint=_DAMAGED
            )
        digest = hashlib.sha256()
        with open(file, "rb") as fh:
            while chunk := fh.read(1 << 22):
                digest.update(chunk)
        if digest.hexdigest() != f.sha256:
            raise VerifyError(
                f"sha256 differs from the manifest's ({f.sha256[:12]}...)", path=file, hint=_DAMAGED
            )
    return len(manifest.files)


def not_an_export(path: Path) -> None:
    """A staged step, a staging ROOT or a sink's prefix given as EXPORT_DIR would be "not a complete
    export" with the hint to consolidate again: name what it is, and the directory meant."""
    weights = (layout.INDEX_NAME, layout.WEIGHTS_NAME, layout.ADAPTER_WEIGHTS_NAME)
    if any((path / n).is_file() for n in weights):
        return
    if (path / layout.MARKER_NAME).exists():
        export = path / layout.EXPORT_DIR
        hint = (
            f"verify its export: `stagerd verify {export} --against {path}`"
            if export.is_dir()
            else f"export it first (`stagerd consolidate {path} OUT`), then verify OUT"
        )
        raise ConfigError("EXPORT_DIR is a staged step, not an export", path=path, hint=hint)
    steps = sorted(
        n for n in os.listdir(path) if layout.parse_step_dir(n) is not None and (path / n).is_dir()
    )
    if steps:
        raise ConfigError(
            "EXPORT_DIR holds step directories (a staging ROOT or a sink's prefix), not an export",
            path=path,
            hint=f"give one of them, e.g. {path / steps[-1]}",
        )


def meant_path(path: Path) -> Path | None:
    """The path a mistyped `path` meant (`closest_existing`), as given: a relative one stays relative."""
    meant = layout.closest_existing(path)
    if meant is None or path.is_absolute():
        return meant
    return Path(os.path.relpath(meant))


def run(args: argparse.Namespace) -> int:
    from stagerd.engine.verify import verify_export
    from stagerd.ops.progress import progress

    check_threads(args.threads)
    for what, given in (("EXPORT_DIR", args.export_dir), ("--against", args.against)):
        if given is not None and "://" in given:
            raise ConfigError(
                f"{what} is a URL; verify reads a local directory",
                path=given,
                hint="download the published step first, `stagerd restore URL OUT --export --step N` (it "
                "checks every file against the sink's manifest as it lands), or give a file:// sink's "
                "step-N/ as its path",
            )
    args.export_dir = Path(args.export_dir)
    args.against = None if args.against is None else Path(args.against)
    for what, path in (("EXPORT_DIR", args.export_dir), ("--against", args.against)):
        if path is not None and not path.exists():
            meant = meant_path(path)
            hint = f"did you mean {meant}?" if meant is not None else "check the path"
            raise ConfigError(f"{what} does not exist", path=path, hint=hint)
        if path is not None and not path.is_dir():
            hint = "give the export's directory" if what == "EXPORT_DIR" else "give the step's directory"
            raise ConfigError(f"{what} is a file, not a directory", path=path, hint=hint)
    not_an_export(args.export_dir)
    if args.against is not None and args.adopt is None:
        refuse_a_root(args.against, "--against")
        warn_uncommitted(args.against)
        refuse_an_hf_checkpoint(
            args.against,
            "--against",
            f"compare with a trainer's checkpoint through --adopt: `stagerd verify {args.export_dir} "
            f"--against {args.against} --adopt`",
        )
    against = args.against
    reading = (
        nullcontext()
        if against is None
        else unstaged_hint(against, "--against", adopted=args.adopt is not None)
    )
    with reading:
        source = adopted_source(args, against) if against is not None else None
        with progress(f"verify {args.export_dir.name}", 0) as bar:
            r = verify_export(args.export_dir, against, threads=args.threads, progress=bar, source=source)
    hashed = check_manifest(args.export_dir)
    equal = f", every byte equal to {r.compared_with}" if r.compared_with else ""
    listed = f", {hashed} files' sha256 as {layout.MANIFEST_NAME} lists" if hashed else ""
    print(f"ok: {r.files} files, {r.tensors} tensors, {r.total_size} bytes{equal}{listed}")
    if r.older_order:
        print(
            f"note: {len(r.older_order)} of {r.files} files lay their tensors out in an older stagerd's"
            " order, not the one save_pretrained writes (loaders read them the same; a new export gives"
            " save_pretrained's bytes)"
        )
    return 0
