"""`stagerd demo`: train a tiny model on 2 CPU processes, stage, export, publish, check; no GPU or network."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from stagerd.cmd.help import UserHelpFormatter

EXAMPLES = """examples:
  stagerd demo                          # everything in a new temp directory
  stagerd demo --root ./demo --steps 5  # keep the run in ./demo
  stagerd demo --sink s3://scratch/stagerd-demo
"""


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser], name: str) -> None:
    p = sub.add_parser(
        name,
        help="try the whole pipeline on this machine in about a minute (no GPU, no network)",
        description=(
            "Train a tiny model with 2 CPU processes, save every step through stagerd.Stager, run "
            "`stagerd watch --once` to export and publish them, then check that every published step loads "
            "with safetensors and equals the trained weights bit for bit."
        ),
        epilog=EXAMPLES,
        formatter_class=UserHelpFormatter,
    )
    p.add_argument(
        "--root",
        type=Path,
        metavar="DIR",
        help="demo directory, kept afterwards: DIR/staging is the staging ROOT, DIR/published the default "
        "sink (default: a new temp directory)",
    )
    p.add_argument(
        "--sink",
        action="append",
        metavar="URL",
        help="publish here instead of DIR/published: s3://BUCKET/PREFIX (AWS_ENDPOINT_URL for a local S3), "
        "hf://ORG/REPO, file:///ABSOLUTE/PATH; repeat for several",
    )
    p.add_argument("--steps", type=int, default=3, metavar="N", help="checkpoints to save (default 3)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from stagerd.demo.plan import make_plan
    from stagerd.demo.run import run_demo
    from stagerd.demo.summary import format_summary

    plan = make_plan(args.root, args.sink, steps=args.steps)
    print(f"stagerd demo: working in {plan.workdir}", flush=True)
    t0 = time.perf_counter()
    result = run_demo(plan)
    print(format_summary(result, time.perf_counter() - t0), flush=True)
    return 0
