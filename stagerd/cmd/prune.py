"""`stagerd prune URL --keep-last N [--keep-every M] [--dry-run]`: remote retention of one fsspec sink.

The same plan the daemon applies after each publish when `--remote-keep-last` / `--remote-keep-every`
are set (`stagerd/sinks/prune.py`): it never deletes the step `latest` names, a step without a manifest
(not published or not verified), a step newer than the newest complete one, or a step a restore is
reading; each deleted step loses its manifest first, then its files. `--dry-run` lists every step with
its fate and the reason, and deletes nothing. The Hub is not pruned: its history is immutable.

Every step is listed with its publisher (host and ROOT, from its claim). A person cleaning a prefix counts
every step, as before; `--root ROOT` applies the daemon's rule instead: only ROOT's steps are counted and
deleted, so two runs that share a prefix can each be cleaned without touching the other's.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from stagerd.cmd.help import UserHelpFormatter
from stagerd.errors import ConfigError

if TYPE_CHECKING:
    from stagerd.sinks.claims import Publisher
    from stagerd.sinks.prune_plan import Decision

EXAMPLES = """examples:
  stagerd prune s3://ckpts/run1 --keep-last 3 --keep-every 1000 --dry-run
  stagerd prune s3://ckpts/run1 --keep-last 3 --keep-every 1000
  # only the steps that ROOT's daemon published
  stagerd prune s3://ckpts/shared --keep-last 3 --root /local_nvme/ckpt
"""


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser], name: str) -> None:
    p = sub.add_parser(
        name,
        help="delete old published steps from an fsspec sink (remote retention)",
        description=(
            "Apply remote retention to the HF exports (PREFIX/step-N/) and raw steps (PREFIX/raw/step-N/) "
            "of one s3://, file:// or fsspec sink: keep the newest --keep-last complete steps and every "
            "--keep-every-th step; never the step latest names, an unverified step, a step newer than the "
            "newest complete one, or one a restore is reading. A deleted step loses its manifest first. "
            "Each step is shown with its publisher; --root limits the prune to one ROOT's steps."
        ),
        epilog=EXAMPLES,
        formatter_class=UserHelpFormatter,
    )
    p.add_argument("url", metavar="URL", help="the sink: s3://BUCKET/PREFIX, file:///PATH, any fsspec URL")
    p.add_argument("--keep-last", type=int, metavar="N", help="keep the newest N complete steps")
    p.add_argument("--keep-every", type=int, metavar="M", help="keep every step that is a multiple of M")
    p.add_argument(
        "--root",
        metavar="ROOT",
        help="count and delete only the steps this ROOT's daemon published (a prefix two runs share)",
    )
    p.add_argument("--dry-run", action="store_true", help="show what would go; delete nothing")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from stagerd.sinks.fetch import RemoteStore
    from stagerd.sinks.places import refuse_a_file
    from stagerd.sinks.prune import Owner, Policy, prune
    from stagerd.sinks.urls import SinkKind, parse_sink_url

    if args.url.startswith("hf://"):
        raise ConfigError(
            "the Hub is not pruned: its history is immutable and tags cost nothing",
            hint="delete tags or branches by hand with huggingface_hub if you must",
        )
    policy = Policy(args.keep_last, args.keep_every)
    if not policy.active:
        raise ConfigError(
            "give --keep-last N and/or --keep-every M", hint="add --dry-run to see what would go"
        )
    # The parser `watch --sink` uses: a typo (`s3:/bkt/run`, `file://relative`) is named, never taken
    # for a local path under the working directory that holds no step (a "successful" prune of nothing).
    target = parse_sink_url(args.url)
    if target.kind is SinkKind.LOCAL:
        refuse_a_file(args.url, str(target.local_path))  # a file in the sink's place, named as by watch
    if target.kind is SinkKind.LOCAL and not target.local_path.is_dir():
        # A directory the daemon publishes to exists from its first publish: one that does not is a typo,
        # which a listing of nothing would report as a prune with nothing to do.
        what = "is not a directory" if target.local_path.exists() else "does not exist"
        raise ConfigError(
            f"sink {what}: no step was ever published there",
            path=target.local_path,
            hint="give the --sink URL the daemon publishes to (`stagerd status ROOT` names it); nothing "
            "was deleted",
        )
    owner = Owner(None if args.root is None else _publisher(Path(args.root)))
    store = RemoteStore.open(args.url)
    try:
        decisions = prune(store, policy, owner=owner, dry_run=args.dry_run)
    finally:
        store.close()
    verb = "would delete" if args.dry_run else "deleted"
    for d in decisions:
        who, why = f"  [{d.publisher}]" if d.publisher else "", d.reason + _uploads(d, args.dry_run)
        print(f"{d.tree:6} step {d.step:>10}  {verb if d.delete else 'keep':12}  {why}{who}")
    if not decisions:
        print(
            f"nothing to prune: no published step under {args.url} (check the URL: it is the --sink the "
            "daemon publishes to)",
            file=sys.stderr,
        )
    gone = sum(d.delete for d in decisions)
    print(f"{gone} step(s) {verb}, {len(decisions) - gone} kept")
    publishers = {d.publisher for d in decisions if d.publisher}
    if args.root is None and len(publishers) > 1:
        print(
            f"note: {len(publishers)} publishers share this prefix and their steps were counted together; "
            "add --root ROOT to count and delete only one ROOT's steps"
        )
    return 0


def _uploads(d: Decision, dry_run: bool) -> str:
    """The multipart uploads pending under a deleted step, which went with it (S3 bills them unseen)."""
    if not d.delete or d.uploads == 0:
        return ""
    if d.uploads is None:
        return "; its pending multipart uploads could not be listed (see the warning)"
    return f"; {d.uploads} pending multipart upload(s) {'to abort' if dry_run else 'aborted'}"


def _publisher(root: Path) -> Publisher:
    from stagerd.sinks.claims import publisher_of

    if not root.is_dir():
        raise ConfigError(
            f"--root {root} is not a directory", hint="give the ROOT the daemon watched (stagerd watch ROOT)"
        )
    return publisher_of(root)
