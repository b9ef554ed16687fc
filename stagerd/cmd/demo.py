"""`stagerd demo`: train a tiny model on 2 CPU processes, stage, export, publish, check; no GPU or network."""

from __future__ import annotations

import argparse
import time
from pathlib import Path


def add_parser(sub: argparse._SubParsersAction, name: str) -> None:
    p = sub.add_parser(
        name,
        help="run the whole pipeline on this machine: training -> Stager -> watch --once -> check",
        description=(
            "Train a tiny model with 2 gloo processes, save every step through stagerd.Stager, run "
            "`stagerd watch --once` to publish them, then check that every published step loads with "
            "safetensors and equals the trained weights bit for bit. Needs no GPU and no network."
        ),
    )
    p.add_argument(
        "--root",
        type=Path,
        metavar="DIR",
        help="demo directory, kept afterwards: DIR/staging is the ROOT, DIR/published the default sink "
        "(default: a new temp directory)",
    )
    p.add_argument(
        "--sink",
        action="append",
        metavar="URL",
        help="publish here instead of DIR/published: s3://BUCKET/PREFIX (set AWS_ENDPOINT_URL for a "
        "local S3), hf://ORG/REPO, file:///PATH; repeat for several",
    )
    p.add_argument("--steps", type=int, default=3, metavar="N", help="checkpoints to save (default 3)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from stagerd.demo.run import DemoError, format_summary, make_plan, run_demo

    if args.steps < 1:
        raise DemoError("--steps must be at least 1", hint="pass --steps 3, for example")
    plan = make_plan(args.root, args.sink, steps=args.steps)
    print(f"stagerd demo: working in {plan.workdir}", flush=True)
    t0 = time.perf_counter()
    result = run_demo(plan)
    print(format_summary(result, time.perf_counter() - t0), flush=True)
    return 0
