"""Phase 2 of the demo, and the whole demo in order: train, `stagerd watch --once`, check."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from stagerd.demo.plan import DemoError, DemoPlan, DemoResult


def _stagerd(
    *args: str, env: dict[str, str] | None = None, capture: bool = False, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "stagerd.cli", *args]
    return subprocess.run(
        cmd, env=env, capture_output=capture, text=True, timeout=timeout, stdin=subprocess.DEVNULL
    )


def run_daemon(plan: DemoPlan, result: DemoResult) -> None:
    """`stagerd watch ROOT --sink URL... --once` as an operator runs it; exit 0 means all were published."""
    argv = ["watch", str(plan.staging), "--once"]
    for sink in plan.sinks:
        argv += ["--sink", sink]
    env = {**os.environ, "STAGERD_METRICS_PORT": "off"}  # two demos at once must not fight for a port
    t0 = time.perf_counter()
    proc = _stagerd(*argv, env=env)
    result.watch_seconds = time.perf_counter() - t0
    status = _stagerd("status", str(plan.staging), "--json", capture=True)
    if status.returncode == 0:
        result.status = json.loads(status.stdout)["steps"]
    if proc.returncode != 0:
        raise DemoError(
            f"`stagerd watch --once` exited {proc.returncode}: not every step was published",
            path=plan.staging,
            hint=f"see the log above and `stagerd status {plan.staging}`",
        )


def run_demo(plan: DemoPlan) -> DemoResult:
    """Train and stage, run the daemon once, check the output. Raises a StagerdError on any failure."""
    from stagerd.demo.check import check
    from stagerd.demo.train import train

    result = DemoResult(plan=plan)
    train(plan, result)
    run_daemon(plan, result)
    check(plan, result)
    return result
