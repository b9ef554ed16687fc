"""`stagerd watch ROOT --sink URL ...`: the per-node daemon."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Collection
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from stagerd.cmd.flag_types import export_dtype
from stagerd.cmd.help import UserHelpFormatter
from stagerd.cmd.watch_hints import (
    given_up_hint,
    retry_hint,
    warn_keep_none,
    warn_quarantined,
    warn_unadopted,
)
from stagerd.contract.dtypes import EXPORT_DTYPE_TEXT
from stagerd.errors import ConfigError

if TYPE_CHECKING:
    from stagerd.config import Settings

DESCRIPTION = (
    "Run beside training on each node. Every step a trainer commits under ROOT is converted to Hugging "
    "Face safetensors, checked, published to each --sink, and its staged data is deleted once --keep-last "
    "newer steps are published. Runs until SIGTERM; --once exits when every committed step is done. "
    "Settings come from --config FILE (TOML), then STAGERD_* variables, then these flags; every setting has "
    "an environment variable and a TOML key, even where it has no flag."
)

EXAMPLES = """examples:
  stagerd watch ./outputs/checkpoint --adopt --sink hf://acme/llm --dtype bf16
  stagerd watch /scratch/run1 --sink hf://acme/llm --sink s3://ckpts/run1
  stagerd watch /scratch/run1 --sink file:///mnt/models --keep-last 2
  stagerd watch /scratch/run1 --sink s3://ckpts/run1 --once   # then exit
  STAGERD_SINKS=s3://ckpts/run1 stagerd watch /scratch/run1
"""


def add_parser(sub: argparse._SubParsersAction, name: str) -> None:
    p = sub.add_parser(
        name,
        help="run the daemon: export committed steps, publish them, apply retention",
        description=DESCRIPTION,
        epilog=EXAMPLES,
        formatter_class=UserHelpFormatter,
    )
    # Every default is None: an absent flag leaves the setting to the environment or the config file.
    p.add_argument(
        "root",
        type=Path,
        nargs="?",
        metavar="ROOT",
        help="staging root the trainers write into (or STAGERD_ROOT)",
    )
    p.add_argument(
        "--sink", dest="sinks", action="append", metavar="URL", help="publish destination (repeatable)"
    )
    p.add_argument("--config", type=Path, metavar="FILE", help="TOML settings file")
    p.add_argument("--dtype", type=export_dtype, metavar="DTYPE", help=f"export dtype: {EXPORT_DTYPE_TEXT}")
    p.add_argument("--keep-dtype", metavar="REGEX", help="tensor names that are never cast")
    p.add_argument(
        "--mapping",
        type=Path,
        metavar="FILE",
        help="key mapping (JSON) for steps saved without a to-Hub plan",
    )
    p.add_argument(
        "--max-shard-size",
        metavar="SIZE",
        help="largest output file, e.g. 5GB (default 50GB; 5GB with --exchange)",
    )
    p.add_argument("--keep-last", type=int, metavar="N", help="keep the newest N steps' staged data")
    p.add_argument(
        "--once",
        action="store_true",
        default=None,
        help="process every committed step, then exit: 0 only if all were published",
    )
    p.add_argument(
        "--publish-raw",
        action="store_true",
        default=None,
        help="also publish each raw step to PREFIX/raw/step-N/ of every fsspec sink (for resume)",
    )
    p.add_argument(
        "--adopt",
        nargs="?",
        const="auto",
        metavar="PRESET",
        help="export the DCP checkpoints a trainer already writes under ROOT (no Stager): auto (default), "
        "hf-trainer, accelerate, automodel, lightning, torchtitan, dcp, hf",
    )
    p.add_argument("--adopt-select", metavar="REGEX", help="adopt: the tensor keys that are the model")
    p.add_argument("--adopt-step", metavar="REGEX", help="adopt: the step number in a directory name")
    p.add_argument("--export-dir", type=Path, metavar="DIR", help="adopt: where exports are built")
    p.add_argument("--extras", type=Path, metavar="DIR", help="adopt: config.json and tokenizer to ship")
    p.add_argument(
        "--delete-adopted",
        action="store_true",
        default=None,
        help="adopt: let --keep-last delete the trainer's published checkpoints too",
    )
    p.add_argument("--exchange", metavar="URL", help="node-local steps: where the nodes meet")
    p.add_argument(
        "--fleet-wait-seconds",
        type=float,
        metavar="S",
        help="node-local steps: how long to wait for the other nodes (default 600)",
    )
    p.add_argument("--remote-keep-last", type=int, metavar="N", help="keep the newest N steps on each sink")
    p.add_argument("--remote-keep-every", type=int, metavar="N", help="and every N-th step on each sink")
    p.add_argument(
        "--sink-retention",
        action="append",
        metavar="URL=last=N,every=M",
        help="remote retention of one sink, instead of --remote-keep-* (repeatable)",
    )
    p.add_argument("--export-workers", type=int, metavar="N", help="exports at once (default 1)")
    p.add_argument("--publish-workers", type=int, metavar="N", help="publishes at once per sink (default 1)")
    p.add_argument(
        "--yield-seconds",
        type=float,
        metavar="S",
        help="most an export or file:// publish pauses for saves being written (default 30; 0 off)",
    )
    p.add_argument(
        "--max-attempts",
        type=int,
        metavar="N",
        help="tries of a failing stage in a --once run; crashes mid-stage before quarantine (default 5)",
    )
    p.add_argument("--grace-seconds", type=float, metavar="S", help="drain time on SIGTERM (default 60)")
    p.add_argument("--rescan-seconds", type=float, metavar="S", help="full rescan period (default 5)")
    p.add_argument(
        "--no-watch", dest="watch", action="store_false", default=None, help="no inotify; rescan only"
    )
    p.add_argument("--nice", type=int, metavar="N", help="raise niceness to at least N (default 10; 0 off)")
    p.add_argument(
        "--io-class", choices=["idle", "best-effort", "none"], help="I/O scheduling class (default idle)"
    )
    p.add_argument("--metrics-host", metavar="ADDR", help="metrics address (default 127.0.0.1)")
    p.add_argument("--metrics-port", metavar="PORT", help="metrics port (default 9464; 0 or off: none)")
    p.set_defaults(func=run)


def open_exchange(url: str) -> None:
    """Open the exchange as the fleet will, and close it, before anything is written: a sink is opened at
    start, and the exchange, opened only when a node-local step needs it, would otherwise fail then, after
    the daemon ran for hours. The parser has taken the URL's scheme and shape (`Settings`): any durable
    fsspec store a sink may be, the Hub not. Opening finds what only the store tells: a URL it cannot take
    (a ConfigError, as an S3 endpoint without a scheme) or a host that connects on open and cannot be
    reached (a SinkError, as for a sink)."""
    from stagerd.errors import SinkError
    from stagerd.sinks.fsspec import FsspecSink

    try:
        FsspecSink.from_url(url).close()
    except (ConfigError, SinkError) as e:
        e.message = e.message.replace(" sink ", " --exchange ", 1)
        if e.hint == SinkError.hint:  # "stagerd retries with backoff": not before it has started
            e.hint = "check that every node reaches the exchange (its host, port, network), then start again"
        raise


def _warn(settings: Settings, lanes: Collection[str]) -> None:
    assert settings.root is not None
    root, unadopted = Path(settings.root), settings.adopt is None
    if unadopted:
        warn_unadopted(root)
    warn_quarantined(root, lanes, adopted=not unadopted, export_dir=settings.export_dir)
    warn_keep_none(
        settings.keep_last, settings.publish_raw, trainer_kept=not unadopted and not settings.delete_adopted
    )


_FLAGS = (
    "root",
    "sinks",
    "dtype",
    "keep_dtype",
    "mapping",
    "max_shard_size",
    "keep_last",
    "once",
    "publish_raw",
    "adopt",
    "adopt_select",
    "adopt_step",
    "export_dir",
    "extras",
    "delete_adopted",
    "exchange",
    "fleet_wait_seconds",
    "remote_keep_last",
    "remote_keep_every",
    "sink_retention",
    "export_workers",
    "publish_workers",
    "yield_seconds",
    "max_attempts",
    "grace_seconds",
    "rescan_seconds",
    "watch",
    "nice",
    "io_class",
    "metrics_host",
    "metrics_port",
)


def run(args: argparse.Namespace) -> int:
    import asyncio

    from stagerd.daemon.settings_sources import load_settings

    if args.sink_retention is not None:
        pairs = [s.partition("=") for s in args.sink_retention]
        if any(not sep or not url for url, sep, _ in pairs):
            raise ConfigError("--sink-retention takes URL=last=N,every=M")
        args.sink_retention = {url.rstrip("/"): spec for url, _, spec in pairs}
    if args.adopt is not None:
        from stagerd.contract.adopt.presets import preset_names, unknown_preset

        if args.adopt not in preset_names():  # said here with the closest name (the settings say none)
            raise unknown_preset(args.adopt, no_root=args.root is None)
    settings = load_settings(args.config, **{k: getattr(args, k) for k in _FLAGS})
    root = settings.root
    if settings.exchange is not None:
        open_exchange(settings.exchange)
    from stagerd.daemon.core import Daemon  # after the settings: a refused command line needs none of it

    # The warnings come once the daemon has checked ROOT's places (a step directory given as ROOT is
    # refused there, before any warning about what it holds), holding its lock, its sinks open.
    on_start = None if root is None else partial(_warn, settings)
    daemon = Daemon(settings, on_start=on_start)
    code = asyncio.run(daemon.run())
    if daemon.summary is not None:
        s = daemon.summary
        print(
            f"stagerd watch --once: {s.published_count} step(s) published, {len(s.unpublished)} not"
            f" ({s.published_now} published by this run)"
        )
        for step, why in s.unpublished:
            print(f"  step {step}: {why}")
        from stagerd.daemon.summary import down_text, lost_text, missed_text, restored_text
        from stagerd.daemon.unfinished import unfinished_text

        for sink, (failure, steps) in s.down.items():
            print(f"  {down_text(sink, failure, steps)}")
        if s.restored[0]:
            print(f"  {restored_text(*s.restored)}")
        if s.unfinished[0]:
            print(f"  {unfinished_text(*s.unfinished, settings.adopt is not None)}")

        for sink, (count, steps) in s.missed.items():
            print(f"  {missed_text(sink, count, steps)}")
        for note in s.nested:
            print(f"  {note}")
        if s.lost[0]:
            print(f"  {lost_text(*s.lost)}")
        if s.given_up:
            print(f"  what to do: {given_up_hint()}")
        if s.quarantined and settings.root is not None:
            print(f"  what to do: {retry_hint(Path(settings.root))}")
    if daemon.left_threads_running:
        # Work abandoned at shutdown is recorded in the journal; its threads cannot be interrupted, and
        # waiting for them would break the grace period. The next start redoes that work.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code
