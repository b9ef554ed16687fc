"""Phase 1 of the demo: a real 2-process gloo training run that saves every step through the Stager."""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
import warnings

from stagerd.contract import commit_marker, layout
from stagerd.demo.plan import WORLD, DemoError, DemoPlan, DemoResult
from stagerd.ops.progress import progress


def _train_rank(rank: int, world: int, init_file: str, plan: DemoPlan, report: str) -> None:
    """One training process: FSDP2 over gloo, a Stager save after every optimizer step."""
    import torch
    import torch.distributed as dist
    from safetensors.torch import save_file
    from torch.distributed.fsdp import fully_shard

    from stagerd.demo.tiny_model import CONFIG, TinyLM, next_token_loss
    from stagerd.training.committer import UNWATCHED
    from stagerd.training.stager import Stager

    warnings.filterwarnings("ignore", category=UserWarning)
    # the demo runs `watch --once` itself once training ends: the note that no daemon runs yet is for users
    logging.getLogger("stagerd.stage").addFilter(lambda r: not r.getMessage().startswith(UNWATCHED))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        model = TinyLM()
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        data = torch.Generator().manual_seed(1000 + rank)
        stager = Stager(root=str(plan.staging))
        stalls = []
        for step in range(1, plan.steps + 1):
            ids = torch.randint(0, CONFIG.vocab_size, (4, 32), generator=data)
            loss = next_token_loss(model(ids[:, :-1]), ids[:, 1:])
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

            sd = model.state_dict()
            t0 = time.perf_counter()
            stager.save(
                sd, step=step, extras={"config.json": CONFIG.as_json()}, metadata={"run": "stagerd-demo"}
            )
            stager.wait_staged()
            stalls.append(time.perf_counter() - t0)
            # The weights as training holds them now: what the published export must equal, bit for bit.
            full = {k: v.full_tensor().contiguous() for k, v in sd.items()}
            if rank == 0:
                plan.expected.mkdir(parents=True, exist_ok=True)
                save_file(full, str(plan.expected / f"{layout.step_dir_name(step)}.safetensors"))
        stager.wait()
        stager.close()
        if rank == 0:
            layout.write_json_atomic(report, {"save_stall_seconds": stalls})
    finally:
        dist.destroy_process_group()


def train(plan: DemoPlan, result: DemoResult) -> None:
    """Train `WORLD` ranks for `plan.steps` steps; every step must end committed in `plan.staging`."""
    import torch.multiprocessing as mp
    from torch.multiprocessing.spawn import ProcessException

    plan.staging.mkdir(parents=True, exist_ok=True)
    report = plan.workdir / "train-report.json"
    fd, init_file = tempfile.mkstemp(prefix="stagerd-demo-gloo-")
    os.close(fd)
    os.unlink(init_file)
    t0 = time.perf_counter()
    try:
        ctx = mp.start_processes(
            _train_rank,
            args=(WORLD, init_file, plan, str(report)),
            nprocs=WORLD,
            start_method="spawn",
            join=False,
        )
        with progress(f"train ({WORLD} gloo ranks) and stage", plan.steps, unit="steps") as bar:
            while not ctx.join(timeout=0.25):
                bar(len(layout.committed_steps(plan.staging)), plan.steps)
            bar(len(layout.committed_steps(plan.staging)), plan.steps)
    except ProcessException as e:
        last = str(e).strip().splitlines()[-1]
        raise DemoError(f"training failed: {last}", path=plan.staging) from None
    finally:
        if os.path.exists(init_file):
            os.unlink(init_file)
    result.train_seconds = time.perf_counter() - t0
    result.save_stall_seconds = json.loads(report.read_text())["save_stall_seconds"]
    for step, step_dir in layout.committed_steps(plan.staging):
        result.staged_bytes[step] = sum(f.size for f in commit_marker.read_marker(step_dir).files)
    if sorted(result.staged_bytes) != list(range(1, plan.steps + 1)):
        raise DemoError(f"expected steps 1..{plan.steps} committed, found {sorted(result.staged_bytes)}")
