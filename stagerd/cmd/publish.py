"""`stagerd publish EXPORT_DIR --sink URL [--sink URL ...] [--step N]`: publish one finished export now."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from stagerd.cmd.help import UserHelpFormatter
from stagerd.contract import layout
from stagerd.errors import ConfigError, StagerdError, VerifyError

EXAMPLES = """examples:
  stagerd publish ./hf-1000 --step 1000 --sink hf://acme/llm
  stagerd publish run1/step-00001000/export --sink s3://ckpts/run1 --sink /mnt/a
"""


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser], name: str) -> None:
    p = sub.add_parser(
        name,
        help="upload one finished export to one or more sinks now, and verify it there",
        description=(
            "Upload EXPORT_DIR as step N to every sink, check the uploaded copy against the export, then "
            "commit the step (its stagerd.manifest.json last, then PREFIX/latest). A step the sink already "
            "holds is left as it is. Every --sink is checked before anything is uploaded. Exit 0 when every "
            "sink holds the step; 3 when a failure may pass on retry (5xx, network); 2 otherwise (bad "
            "credentials, a different upload of the step already there, bad input)."
        ),
        epilog=EXAMPLES,
        formatter_class=UserHelpFormatter,
    )
    p.add_argument("export_dir", type=Path, metavar="EXPORT_DIR", help="a finished export directory")
    p.add_argument(
        "--sink",
        action="append",
        required=True,
        metavar="URL",
        help="s3://BUCKET/PREFIX (AWS_ENDPOINT_URL for MinIO/Ceph/R2), hf://ORG/REPO[@REVISION], "
        "file:///ABSOLUTE/PATH or /ABSOLUTE/PATH, or PROTOCOL://BUCKET/PATH of an installed fsspec "
        "package; repeat for several",
    )
    p.add_argument(
        "--step",
        type=int,
        metavar="N",
        help="step number (default: parsed from a ROOT/step-XXXXXXXX/export path)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object per sink instead of text")
    p.set_defaults(func=run)


def step_from_path(export_dir: Path) -> int | None:
    """The step of a `.../step-XXXXXXXX/export` directory, or None."""
    resolved = export_dir.resolve()
    if resolved.name != layout.EXPORT_DIR:
        return None
    return layout.parse_step_dir(resolved.parent.name)


def run(args: argparse.Namespace) -> int:
    from stagerd.ops.progress import progress
    from stagerd.sinks import open_sink
    from stagerd.sinks.own_places import check_sinks

    check_sinks(args.sink)  # as `watch` checks its sinks: parsed, none twice, none inside another's places
    for url in args.sink:
        _refuse_staging_areas(url)  # every URL is checked before any sink is touched
    export_dir: Path = args.export_dir
    if not export_dir.is_dir():
        raise VerifyError("is not an export directory", path=export_dir)
    step = args.step if args.step is not None else step_from_path(export_dir)
    if step is None:
        inside = export_dir / layout.EXPORT_DIR
        raise ConfigError(
            f"cannot tell the step of {export_dir}: it is not a step-XXXXXXXX/export directory",
            # a step directory given for its export: the export inside is what publish takes
            hint=f"give its export, {inside}" if step_from_path(inside) is not None else "pass --step N",
        )
    if not 0 <= step <= layout.MAX_STEP:
        raise ConfigError(f"--step must be from 0 to 2^63 - 1, got {step}")
    _check_is_an_export(export_dir)

    failures: list[StagerdError] = []
    for url in args.sink:
        try:
            sink = open_sink(url)
        except StagerdError as e:
            failures.append(_report(e))
            continue
        try:
            with progress(f"publish step {step} to {sink.url}", 0) as bar:
                res = sink.publish(export_dir, step, progress=bar)
        except StagerdError as e:
            failures.append(_report(e, sink.url))
            continue
        finally:
            sink.close()
        if args.json:
            print(json.dumps({"ok": True, **vars(res)}), flush=True)
        elif res.skipped:
            print(f"{res.sink}: step {step} already published at {res.location}", flush=True)
        else:
            from stagerd.cmd.status_table import size

            rate = size(res.bytes_uploaded / res.seconds) + "/s" if res.seconds > 0 else "-"
            print(
                f"{res.sink}: published step {step} to {res.location}: {res.files} files, "
                f"{res.bytes_uploaded} of {res.bytes_total} bytes sent in {res.seconds:.1f} s "
                f"({rate})",
                flush=True,
            )
    if not failures:
        return 0
    return 3 if all(e.retryable for e in failures) else 2


def _refuse_staging_areas(url: str) -> None:
    """A local sink that is a staging ROOT, or lies in one of its step directories or its `.stagerd`, would
    put `step-N/` among the staged steps: a step directory without a marker that the daemon takes for a
    save in progress and never deletes, or files inside a committed step. `watch` refuses its own ROOT;
    publish has no ROOT, so it looks for one above the sink."""
    from stagerd.cmd.staging_places import staging_area
    from stagerd.sinks.urls import SinkKind, parse_sink_url, shown

    target = parse_sink_url(url)
    if target.kind is not SinkKind.LOCAL:
        return
    inside = staging_area(Path(target.local_path))
    if inside is not None:
        raise ConfigError(
            f"sink {shown(url)} is {inside}: its step-N/ directories would land among the staged steps",
            hint="publish to a directory outside the staging ROOT, e.g. file:///mnt/models/run1; nothing "
            "was written",
        )


def _check_is_an_export(export_dir: Path) -> None:
    """Run verify's checks before anything is uploaded: a torn file or a staged step directory published
    with `--step` would become a committed step that no client loads, and that the daemon then refuses
    for good as a conflict."""
    from stagerd.engine.verify import verify_export

    staged = [
        n for n in (layout.MARKER_NAME, layout.MODEL_DIR, layout.OPTIM_DIR) if (export_dir / n).exists()
    ]
    if staged:
        raise VerifyError(
            f"holds {', '.join(staged)}: this is a staged step, not its export",
            path=export_dir,
            hint=f"publish its {layout.EXPORT_DIR}/ directory, or build one with `stagerd consolidate`",
        )
    try:
        verify_export(export_dir)
    except VerifyError as e:
        raise VerifyError(
            f"not published: {e.message}",
            path=e.path,
            hint="publish only a finished export: `stagerd verify EXPORT_DIR` shows what is wrong",
        ) from None


def _report(e: StagerdError, sink: str | None = None) -> StagerdError:
    """Print a failure the way `stagerd` prints any StagerdError, so one sink's failure spares the others."""
    where = f" [{sink}]" if sink and sink not in str(e) else ""
    print(f"stagerd: {e.name}{where}: {e}", file=sys.stderr)
    print(f"  what to do: {e.hint}", file=sys.stderr)
    return e
