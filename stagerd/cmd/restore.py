"""`stagerd restore URL ROOT [--step N|latest]`: a raw step published by `watch --publish-raw` back into ROOT.

1. ROOT's lock is taken, as the daemon takes it: a ROOT a running daemon watches is refused
   (`LockError`), and a daemon started during a restore is refused until it ends.
2. The step (`--step N`, or the one `PREFIX/raw/latest` names) must not be committed in ROOT
   (`StepExistsError`). Its raw manifest is read strictly, and every file it lists must be on the sink at
   its size before anything downloads: a missing object is a `RestoreError` naming it.
3. The files download into `ROOT/.stagerd/restore/step-N/` (parallel ranged reads, sha256 checked while
   they arrive: a corrupt object is a `RestoreError` naming it), fsynced, with progress.
4. The directory is renamed to `ROOT/step-N` without its marker (a daemon ignores it), the journal records
   the step as restored (`retired`: the daemon never exports, publishes or deletes it, and a scan takes
   its marker for this save), the ROOT that published the step joins ROOT's lineage (a run resumed on
   another node: its daemon's retention prunes that ROOT's steps as its own; `sinks/restored_from.py`),
   and the marker is written last, atomically.

A kill at any point leaves nothing that looks committed; running the command again lands the step once.
`--export OUT` restores the published HF export of the step (`PREFIX/step-N/`) into a plain directory,
checked against its manifest the same way, for evaluation jobs.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from stagerd.cmd.help import UserHelpFormatter
from stagerd.errors import ConfigError, SinkError

if TYPE_CHECKING:
    from stagerd.contract.manifest import ExportManifest
    from stagerd.sinks.fetch import RemoteStore

EXAMPLES = """examples:
  stagerd restore s3://ckpts/run1 /local_nvme/ckpt    # the newest raw step
  stagerd restore s3://ckpts/run1 /local_nvme/ckpt --step 1200
  stagerd restore file:///mnt/ckpts/run1 /local_nvme/ckpt --step latest
  # the HF export, for evaluation; then the same from the Hub's tag
  stagerd restore s3://ckpts/run1 ./eval-1200 --export --step 1200
  stagerd restore hf://acme/llm ./eval-1200 --export --step 1200
"""

RESTORE_DIR = "restore"


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser], name: str) -> None:
    p = sub.add_parser(
        name,
        help="bring a published raw step back from a sink into ROOT as a committed step",
        description=(
            "Download a raw step that `stagerd watch --publish-raw` published (PREFIX/raw/step-N/), check "
            "every file's size and sha256 against its manifest while it downloads, and land it in ROOT as "
            "a committed step, marker last. Refuses a ROOT that a running daemon watches, a step ROOT "
            "already has, and a missing or corrupt remote file (naming it; nothing is landed). A restored "
            "step is recorded in ROOT's journal so the daemon never publishes it again. With --export, "
            "the step's HF export is restored into the plain directory ROOT instead."
        ),
        epilog=EXAMPLES,
        formatter_class=UserHelpFormatter,
    )
    p.add_argument("url", metavar="URL", help="the sink: s3://BUCKET/PREFIX, file:///PATH, any fsspec URL")
    p.add_argument("root", type=Path, metavar="ROOT", help="the staging root (with --export: OUT)")
    p.add_argument("--step", default="latest", metavar="N|latest", help="which step (default: latest)")
    p.add_argument("--export", action="store_true", help="restore the HF export into a plain directory")
    p.add_argument("--workers", type=int, default=8, metavar="N", help="parallel downloads (default 8)")
    p.set_defaults(func=run)


def _step(text: str) -> int | None:
    if text == "latest":
        return None
    # ASCII only: str.isdigit() also takes '²' (which int() refuses) and other scripts' digits.
    if not (text.isascii() and text.isdigit()) or len(text) > 19 or int(text) > 2**63 - 1:
        raise ConfigError(f"--step must be a step number below 2^63 or 'latest', got {text!r}")
    return int(text)


def run(args: argparse.Namespace) -> int:
    from stagerd.sinks.fetch import RemoteStore
    from stagerd.sinks.objects import redact_url
    from stagerd.sinks.urls import parse_sink_url, unwritable

    if not 1 <= args.workers <= 256:
        raise ConfigError(f"--workers must be between 1 and 256, got {args.workers}")
    if "://" not in args.url and not args.url.startswith("/"):  # hf:// included
        raise ConfigError(f"{args.url!r} is not a sink URL", hint="use s3://BUCKET/PREFIX or file:///PATH")
    if not args.export and (why := unwritable(args.url)) is not None:
        raise ConfigError(
            f"{redact_url(args.url)} {why}: restoring a raw step writes a lease there, so that no prune "
            "removes the step while it downloads",
            hint="restore the step's HF export with --export, or restore from the store it was published to",
        )
    if not (args.export and unwritable(args.url)):
        # The parser publish and prune use: `file://relative`, `s3://` without a bucket, `memory://`, a
        # %-escape or an upper-case scheme is named, never read loosely as some other place to restore from.
        # A read-only store (http://) is no sink, but an export can be restored from it.
        parse_sink_url(args.url)
    step = _step(args.step)
    root = Path(os.path.abspath(args.root))  # `.` or `./` (the empty directory one is in) has a name then
    if args.url.startswith("hf://"):
        print(f"restored {restore_from_hub(args.url, root, step, export=args.export)}")
        return 0
    try:
        store = RemoteStore.open(args.url, workers=args.workers)
        try:
            if args.export:
                out = restore_export(store, root, step, workers=args.workers)
            else:
                out = restore_raw(store, root, step, workers=args.workers)
        finally:
            store.close()
    except SinkError as e:
        if e.retryable and e.hint == SinkError.hint:  # "stagerd retries with backoff": not a restore
            e.hint = GAVE_UP
        raise
    print(f"restored {out}")
    return 0


GAVE_UP = (
    "nothing was restored; check that the store answers (the network; for S3, its endpoint: "
    "AWS_ENDPOINT_URL), then run the restore again"
)


def restore_from_hub(url: str, out: Path, step: int | None, *, export: bool) -> Path:
    """The HF export of a step from the Hub into the plain directory `out` (raw steps are never there)."""
    from stagerd.ops.progress import progress
    from stagerd.sinks.hub.fetch import restore_hub_export

    if not export:
        raise ConfigError(
            "the Hub holds HF exports only, not raw steps: add --export to restore one into a directory",
            hint="raw steps come back from the s3:// or file:// sink `watch --publish-raw` sent them to",
        )
    check_out(out)
    make_dir(out.parent)
    with progress(f"restore {url.split('?')[0]} into {out}", 0) as bar:
        return restore_hub_export(url, out, step, progress=bar)


def _download(
    store: RemoteStore, prefix: str, manifest: ExportManifest, dest: Path, workers: int, what: str
) -> None:
    from stagerd.ops.progress import progress
    from stagerd.sinks.fetch import download

    total = sum(f.size for f in manifest.files)
    with progress(what, total) as bar:
        download(store, prefix, manifest.files, dest, workers=workers, progress=bar)


def refuse_links(path: Path) -> None:
    """`SymlinkError` if `path`, or any directory above it, is a symbolic link: a restore creates, renames
    and deletes there, and a link would take that elsewhere (another ROOT's step, a shared directory)."""
    p = Path(os.path.abspath(path))
    for q in [*reversed(p.parents), p]:
        if q.is_symlink():
            from stagerd.errors import SymlinkError

            raise SymlinkError(
                f"goes through the symbolic link {q} (-> {os.readlink(q)}); restore never writes via links",
                path=path,
                hint=f"give the real path ({os.path.realpath(path)}), or replace the link by a directory; "
                "nothing was changed",
            )


_NEW_OUT = "give --export a new or empty directory"


def check_out(out: Path) -> None:
    """`--export` OUT: a new or empty directory, reached through no link, that a finished directory can be
    renamed onto (no mount point), and outside a staging ROOT's steps and state (`staging_places.py`)."""
    from stagerd.cmd.staging_places import refuse_a_mount_point, refuse_staging_area

    refuse_links(out)
    if out.exists() and not out.is_dir():
        raise ConfigError("is a file, not a directory; not overwritten", path=out, hint=_NEW_OUT)
    if out.exists() and any(out.iterdir()):
        raise ConfigError("exists and is not an empty directory; not overwritten", path=out, hint=_NEW_OUT)
    refuse_a_mount_point(out, "OUT")
    refuse_staging_area(out, "OUT")


def make_dir(path: Path) -> None:
    """`path` as a directory (made if missing), or a ConfigError naming it: a file where a directory must
    be (ROOT, or a directory above OUT) or one that may not be made is bad input, not a traceback."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(
            f"cannot be a directory: {e.strerror or type(e).__name__}", path=path, hint="give another path"
        ) from None


def restore_raw(store: RemoteStore, root: Path, step: int | None, *, workers: int = 8) -> Path:
    """Land the raw step from `store` in `root` (see the module docstring); its directory."""
    from stagerd.cmd.staging_places import refuse_staging_area

    refuse_links(root)
    refuse_staging_area(root, "ROOT", root_ok=True)
    made = not os.path.lexists(root)
    make_dir(root)
    try:
        return _land_raw(store, root, step, workers)
    except BaseException:
        if made:
            _unmake_root(root)
        raise


def _unmake_root(root: Path) -> None:
    """Remove the ROOT a failed restore made, when it holds only the lock the restore took: a wrong URL or
    step must not leave a new, empty staging ROOT behind it."""
    from stagerd.contract import layout
    from stagerd.daemon.lock import LOCK_NAME

    state = root / layout.STATE_DIR
    try:
        if os.listdir(root) == [layout.STATE_DIR] and set(os.listdir(state)) <= {LOCK_NAME, RESTORE_DIR}:
            shutil.rmtree(root)
    except OSError:
        pass  # left as it is: someone else uses it now


def _land_raw(store: RemoteStore, root: Path, step: int | None, workers: int) -> Path:
    from stagerd.cmd import staging_places
    from stagerd.cmd.restore_nodes import merge_nodes, raw_parts
    from stagerd.contract import commit_marker, layout
    from stagerd.contract.step.lock import StepLock
    from stagerd.daemon.journal import Journal
    from stagerd.daemon.lock import RootLock
    from stagerd.errors import RestoreError, StepExistsError
    from stagerd.ops.crashpoints import crash_point, delay_point
    from stagerd.sinks import restored_from
    from stagerd.sinks.fetch import check_listing, resolve_step, step_prefix
    from stagerd.sinks.leases import Lease, refuse_pruning

    lock = RootLock(root, "restore")
    lock.acquire()  # LockError while a daemon watches ROOT
    try:
        step = resolve_step(store, step, raw=True)
        step_dir = root / layout.step_dir_name(step)
        work = root / layout.STATE_DIR / RESTORE_DIR
        for p in (step_dir, work):
            refuse_links(p)
        with StepLock(root, step, "a restore"):  # StepBusyError while a Stager saves this step
            if layout.is_committed(step_dir):
                raise StepExistsError(
                    f"step {step} is already committed in ROOT; not overwritten",
                    path=step_dir,
                    hint=f"`Stager.load(..., step={step})` reads it as it is; to fetch the sink's copy "
                    "instead, delete the step directory first",
                )
            staging_places.refuse_foreign_files(step_dir)  # before a byte downloads
            prefix = step_prefix(step, raw=True)
            shutil.rmtree(work, ignore_errors=True)  # what a killed restore left; we hold the lock
            tmp = work / step_dir.name
            try:
                with Lease(store, step):  # before the step's first read: a prune meanwhile leaves it
                    refuse_pruning(store, prefix, step)
                    parts = raw_parts(store, prefix, step)
                    for part, manifest in parts:
                        if manifest.metadata.get("raw") is not True or layout.MARKER_NAME not in {
                            f.path for f in manifest.files
                        }:
                            raise RestoreError(
                                "is not a raw step's manifest (no commit marker listed)",
                                path=store.where(part),
                            )
                        check_listing(store, part, manifest)
                    tmp.mkdir(parents=True)
                    for part, manifest in parts:
                        dest = tmp if part == prefix else tmp / part.rsplit("/", 1)[1]
                        _download(store, part, manifest, dest, workers, f"restore step {step}")
                    # read under the lease: a prune deletes the claim with the step
                    publishers = restored_from.publishers(store, [p for p, _ in parts])
                if len(parts) > 1:
                    merge_nodes(tmp, [tmp / p.rsplit("/", 1)[1] for p, _ in parts], store.where(prefix))
                # its directory name is the step's: checked against it
                marker = commit_marker.read_marker(tmp)
                if marker.step != step:
                    raise RestoreError(f"the marker is for step {marker.step}", path=store.where(prefix))
                commit_marker.check_staged_files(tmp, marker)
                marker_bytes = (tmp / layout.MARKER_NAME).read_bytes()
                os.unlink(tmp / layout.MARKER_NAME)
                delay_point("restore.landing")
                refuse_links(step_dir)
                staging_places.refuse_foreign_files(step_dir)  # again: files put there meanwhile
                if step_dir.exists():  # uncommitted: a crashed save, or a killed restore's landing
                    shutil.rmtree(step_dir)
                os.rename(tmp, step_dir)
                layout.fsync_dir(root)
            finally:
                shutil.rmtree(work, ignore_errors=True)
            crash_point("restore.landed")
            identity = "sha256:" + hashlib.sha256(marker_bytes).hexdigest()
            journal = Journal.open(root)
            try:
                journal.record_restored(step, step_dir, identity, store.url)
            finally:
                journal.close()
            crash_point("restore.journaled")
            restored_from.record(root, step, publishers, store.url)
            layout.write_bytes_atomic(step_dir / layout.MARKER_NAME, marker_bytes)
        return step_dir
    finally:
        lock.release()


def restore_export(store: RemoteStore, out: Path, step: int | None, *, workers: int = 8) -> Path:
    """The published HF export of a step into the new directory `out`, checked against its manifest."""
    from stagerd.errors import OutputError
    from stagerd.sinks.fetch import check_listing, read_manifest, resolve_step, step_prefix
    from stagerd.sinks.leases import Lease, refuse_pruning
    from stagerd.sinks.temp_names import restore_temp

    check_out(out)
    step = resolve_step(store, step, raw=False)
    prefix = step_prefix(step, raw=False)
    with Lease(store, step):  # before the step's first read: a prune meanwhile leaves it (`leases.py`)
        refuse_pruning(store, prefix, step)
        manifest = read_manifest(store, prefix, step)
        check_listing(store, prefix, manifest)
        make_dir(out.parent)  # only now: a wrong URL or step leaves no new directory behind
        tmp = restore_temp(out)
        try:
            tmp.mkdir(parents=True)
            _download(store, prefix, manifest, tmp, workers, f"restore the export of step {step}")
            if out.exists():
                out.rmdir()
            os.rename(tmp, out)
        except FileExistsError:
            raise OutputError("appeared while restoring; not overwritten", path=out) from None
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out
