"""Count SIGABRTs at process exit after using the Stager, beside CPU load (issue 17's repro, N times).

A trainer that saved through the Stager, closed it (or forgot to) and exited used to die now and then
with "terminate called without an active exception" (SIGABRT) once the machine was busy. Each run here is
a 2-rank gloo job that saves two steps of DTensors, then goes through one of the failure paths (a refused
step, a failed save, a peer that died, the Stager group's timeout, or none; closing the Stager or not),
then a last collective of its own and exits. The script counts the runs that did not exit 0.

    python bench/stress_exit.py --runs 200                   # every scenario in turn, beside a busy loop
    python bench/stress_exit.py --runs 50 --scenario refused --no-load
"""

from __future__ import annotations

import argparse
import collections
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SCENARIOS = ("refused", "no-close", "failed-save", "lost-contact", "timeout", "clean")

WORKER = r"""
import os, sys, tempfile, time, torch, torch.distributed as dist, torch.multiprocessing as mp

def must_fail(st, sd, step):
    from stagerd.errors import StagerdError
    try:
        st.save(sd, step=step); st.wait()
    except StagerdError:
        return
    sys.exit(f"the save of step {step} did not fail")

def worker(rank, world, init, root, scenario):
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor, Shard, Replicate
    from stagerd import Stager
    mesh = init_device_mesh("cpu", (world,))
    st = Stager(root=root, timeout=3 if scenario == "timeout" else None)
    for step in (10, 20):
        full = {f"w{i}": torch.randn(515, 256) for i in range(12)}
        full["e"] = torch.randn(1003, 256).to(torch.bfloat16); full["n"] = torch.randn(256)
        place = lambda v: [Replicate() if v.dim() == 1 else Shard(0)]
        sd = {k: distribute_tensor(v, mesh, place(v)) for k, v in full.items()}
        st.save(sd, step=step); st.wait_staged()
    st.wait()
    if scenario == "refused":
        must_fail(st, sd, 20)                   # refused: the step is committed
    elif scenario == "failed-save":
        if rank == 0:                           # a file where step 30's directory goes: DCP's write fails
            open(os.path.join(root, "step-00000030"), "w").close()
        must_fail(st, sd, 30)
    elif scenario == "lost-contact":
        if rank == 1:
            os._exit(0)                         # the peer is gone: rank 0's next save loses contact
        must_fail(st, sd, 30)
        st.close()
        return                                  # no collective left to run with a dead peer
    elif scenario == "timeout":
        if rank == 0:
            must_fail(st, sd, 30)               # rank 1 never joins: the group's timeout runs out
        else:
            time.sleep(5)
    if scenario != "no-close":
        st.close()
    out = [None] * world if rank == 0 else None
    dist.gather_object({"r": rank}, out, dst=0)
    dist.destroy_process_group()

if __name__ == "__main__":
    mp.start_processes(worker, args=(2, tempfile.mktemp(), sys.argv[1], sys.argv[2]), nprocs=2, join=True,
                       start_method="spawn")
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--scenario", choices=(*SCENARIOS, "all"), default="all")
    ap.add_argument("--no-load", action="store_true", help="no CPU-bound process beside the runs")
    ap.add_argument("--timeout", type=float, default=180.0, help="seconds per run")
    args = ap.parse_args()
    scenarios = SCENARIOS if args.scenario == "all" else (args.scenario,)

    work = Path(tempfile.mkdtemp(prefix="stagerd-stress-exit-"))
    script = work / "repro.py"
    script.write_text(WORKER)
    load = None if args.no_load else subprocess.Popen(["sh", "-c", "while :; do :; done"])
    outcomes: collections.Counter[tuple[str, str]] = collections.Counter()
    started = time.monotonic()
    try:
        for run in range(args.runs):
            scenario = scenarios[run % len(scenarios)]
            root = work / f"root-{run}"
            try:
                proc = subprocess.run(
                    [sys.executable, str(script), str(root), scenario],
                    capture_output=True,
                    text=True,
                    timeout=args.timeout,
                )
                if proc.returncode == 0:
                    outcome = "ok"
                elif "SIGABRT" in proc.stderr or "terminate called" in proc.stderr:
                    outcome = "SIGABRT"
                else:
                    outcome = f"rc={proc.returncode}"
                    print(proc.stderr[-2000:], file=sys.stderr)
            except subprocess.TimeoutExpired:
                outcome = "hang"
            outcomes[(scenario, outcome)] += 1
            subprocess.run(["rm", "-rf", str(root)], check=False)
            if outcome != "ok":
                print(f"run {run} ({scenario}): {outcome}", flush=True)
    finally:
        if load is not None:
            load.kill()
        subprocess.run(["rm", "-rf", str(work)], check=False)
    elapsed = time.monotonic() - started
    bad = sum(n for (_, outcome), n in outcomes.items() if outcome != "ok")
    print(f"{args.runs} runs in {elapsed:.0f} s, {'beside' if load else 'without'} CPU load: {bad} not clean")
    for (scenario, outcome), n in sorted(outcomes.items()):
        print(f"  {scenario:12s} {outcome:8s} {n}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
