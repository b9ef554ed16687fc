"""Soak: the load test of `tests/test_load.py`, longer, with the daemon's RSS/fds/threads over time.

    python bench/soak.py [--steps 1000] [--backlog 8] [--keep-last 6] [--timeout 900] [--json OUT]
                         [--allocator default|steady]

One long-running `stagerd watch` publishes `--steps` small real DCP steps (copies of one 2-rank gloo save)
to two file:// sinks and to moto S3 behind the fault proxy, which flaps (a 500 or 503 every second, the
endpoint down for 1 s every 5 s). Prints the RSS/fd/thread figures per tenth of the run and a JSON
summary: the early window (25-35% of the steps done) against the late one (85-100%).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

MiB = 1 << 20


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--backlog", type=int, default=8)
    ap.add_argument("--keep-last", type=int, default=6)
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--json", type=Path)
    ap.add_argument(
        "--allocator",
        choices=("default", "steady"),
        default="default",
        help="steady: the daemon runs with MALLOC_ARENA_MAX=2 and a fixed 1 MiB mmap threshold, so RSS "
        "shows live memory rather than glibc's cached arenas and 8 MiB buffers (as the load test)",
    )
    a = ap.parse_args()
    if a.steps < 40:  # the early and late windows each need steps done in them to be compared
        ap.error("--steps must be at least 40")

    from tests.daemon.test_load import STEADY_ALLOCATOR, run_load
    from tests.dcp_fixtures import dcp_save
    from tests.s3server import S3Env, S3TestServer

    with tempfile.TemporaryDirectory(prefix="stagerd-soak-") as tmp_s:
        tmp = Path(tmp_s)
        model = tmp / "model"
        dcp_save(model, world=2)
        server = S3TestServer()
        try:
            os.environ.update(server.aws_env(tmp / "absent"))
            client = server.client()
            bucket = f"stagerd-soak-{uuid.uuid4().hex[:8]}"
            client.create_bucket(Bucket=bucket)
            run = tmp / "run"
            run.mkdir()
            r = run_load(
                run,
                model,
                S3Env(server, bucket, client),
                steps=a.steps,
                backlog=a.backlog,
                keep_last=a.keep_last,
                timeout=a.timeout,
                env=STEADY_ALLOCATOR if a.allocator == "steady" else None,
            )
        finally:
            server.stop()
        print(
            f"{'done':>6} {'t (s)':>7} {'RSS MiB min/median/max':>24} {'fds min/max':>12} {'socks':>5} "
            f"{'threads min/max':>16}"
        )
        for tenth in range(10):
            w = r.window(tenth / 10, (tenth + 1) / 10)
            if not w:
                continue
            rss = [s.rss / MiB for s in w]
            print(
                f"{w[-1].done:>6} {w[-1].t:>7.1f} "
                f"{min(rss):>10.1f} {statistics.median(rss):>6.1f} {max(rss):>6.1f} "
                f"{min(s.fds - s.sockets for s in w):>8} {max(s.fds - s.sockets for s in w):>3} "
                f"{max(s.sockets for s in w):>5} "
                f"{min(s.threads for s in w):>12} {max(s.threads for s in w):>3}"
            )
        figures = {**r.figures(), "exit_code": r.exit_code}
        print(json.dumps(figures, indent=2))
        if a.json:
            a.json.write_text(json.dumps(figures, indent=2) + "\n")
        return 0 if r.exit_code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
