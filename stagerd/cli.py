"""stagerd turns training checkpoints into Hugging Face models and publishes them.

Trainers save each step through stagerd.Stager into a staging ROOT. `stagerd watch` runs beside them on
each node: it converts every committed step to safetensors and uploads it to the Hub, S3 or a directory,
then deletes old staged steps.
"""

from __future__ import annotations

import importlib
import logging
import os
import signal
import sys

from stagerd import __version__
from stagerd.cmd.arg_errors import CommandParser
from stagerd.errors import ConfigError, StagerdError

# subcommand -> module under stagerd.cmd; imported lazily so `stagerd status` never pays for torch.
COMMANDS = {
    "watch": "watch",
    "status": "status",
    "consolidate": "consolidate",
    "verify": "verify",
    "publish": "publish",
    "retry": "retry",
    "restore": "restore",
    "prune": "prune",
    "demo": "demo",
}

EXAMPLES = """examples:
  stagerd demo                      # try it all on this machine first
  stagerd watch /scratch/run1 --sink hf://acme/llm --sink s3://ckpts/run1
  stagerd status /scratch/run1
  stagerd retry /scratch/run1 --step 1200   # once its failure is fixed
  stagerd consolidate /scratch/run1/step-00001000 ./hf-1000

sinks (--sink URL): s3://BUCKET/PREFIX, hf://ORG/REPO[@REVISION], file:///ABSOLUTE/PATH (a bare
/ABSOLUTE/PATH means the same), or PROTOCOL://BUCKET/PATH of an installed fsspec package (gcsfs for gs://).
Relative paths and memory:// are refused.

Run `stagerd COMMAND --help` for each command's options. Exit status: 0 done, 1 `watch --once` left a
step unpublished, 2 bad input or configuration (retrying will not help), 3 a failure that may pass on
retry, 130 interrupted, 141 the reader of its output closed it (`| head`).
"""

log = logging.getLogger("stagerd")


def build_parser() -> CommandParser:
    from stagerd.cmd.help import UserHelpFormatter

    parser = CommandParser(
        prog="stagerd", description=__doc__, epilog=EXAMPLES, formatter_class=UserHelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"stagerd {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks and debug logs")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, module in COMMANDS.items():
        try:
            mod = importlib.import_module(f"stagerd.cmd.{module}")
        except ModuleNotFoundError as e:
            if e.name != f"stagerd.cmd.{module}":
                raise
            continue  # a command whose module is not built yet is absent, not faked
        mod.add_parser(sub, name)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # said by the command's parser, which knows the flag meant
        parser.command_parser(args.command).refuse_unknown(extra, parser)
    from stagerd.ops import stacks
    from stagerd.ops.fdlimit import raise_open_files_limit
    from stagerd.ops.logs import setup_logging

    setup_logging(debug=args.debug)
    raise_open_files_limit()
    stacks.install()  # `kill -USR1 PID`: where a command that seems stuck waits, logged, and it goes on
    try:
        rc = int(args.func(args) or 0)
        sys.stdout.flush()  # here, where a reader gone (`| head`) is caught, not in the exit's flush
        return rc
    except BrokenPipeError:
        # the reader of the output closed it: end as a command killed by SIGPIPE does, without a traceback
        # from the interpreter's own flush at exit
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    except StagerdError as e:
        if args.debug:
            log.exception("%s", e)
        print(f"stagerd: {e.name}: {e}", file=sys.stderr)
        print(f"  what to do: {_hint(e, args.command)}", file=sys.stderr)
        return 2 if not e.retryable else 3
    except KeyboardInterrupt:
        print("stagerd: interrupted", file=sys.stderr)
        return 130


def _hint(e: StagerdError, command: str) -> str:
    """A ConfigError's generic hint names `stagerd watch`, whose settings most of them are; under another
    command it would send the user to the wrong help."""
    if isinstance(e, ConfigError) and e.hint == ConfigError.hint and command != "watch":
        return f"see `stagerd {command} --help`"
    return e.hint


if __name__ == "__main__":
    sys.exit(main())
