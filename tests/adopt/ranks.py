"""What the ranks of the adoption tests run: trainers' own save code, nothing of stagerd's.

`async_save_loop`: a tiny HF Llama under FSDP2 on 2 gloo ranks, trained a few steps, saved after each by a
plain `dcp.async_save` of `{"model": ..., "optim": ...}` into `ROOT/step-N` (on its own gloo group, the
previous save awaited before the next, as torch's docs show); rank 0 then writes `save_pretrained` of the
gathered trained weights in bf16 as the reference, and config.json into ROOT, where a training script
keeps it.

`killed_writer`: one process saving with DCP's FileSystemWriter and SIGKILLed inside `finish()`, before
the coordinator writes `.metadata` or right after: a writer that dies half way, as a pre-empted job does.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

from tests.fidelity import models
from tests.gloo import join

STEPS = 3


def async_save_loop(rank: int, world: int, init_file: str, root: str, ref: str, kind: str) -> None:
    join(rank, world, init_file)
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = models.build(kind)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(5)
    pending = None
    save_group = torch.distributed.new_group(backend="gloo")  # async_save's own, as torch's docs advise
    for step in range(1, STEPS + 1):
        ids = torch.randint(0, models.VOCAB, (2, 12), generator=g)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        if pending is not None:
            pending.result()
        state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
        pending = dcp.async_save(
            state, checkpoint_id=str(Path(root) / f"step-{step}"), process_group=save_group
        )
    assert pending is not None
    pending.result()
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        torch.manual_seed(0)
        plain = models.build(kind)
        plain.load_state_dict(full)
        plain.to(torch.bfloat16).save_pretrained(Path(ref) / "bf16")
        (Path(root) / "config.json").write_text(json.dumps(json.loads(plain.config.to_json_string())))


def _tensors() -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(3)
    return {"model": {"w": torch.randn(8, 4, generator=g), "b": torch.randn(8, generator=g)}}


def killed_writer(_rank: int, path: str, when: str) -> None:
    """Save `_tensors()` to `path`, SIGKILLed in `finish()` `before` or `after` `.metadata` is written."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    class Dying(FileSystemWriter):
        def finish(self, metadata: Any, results: Any) -> None:
            if when == "after":
                super().finish(metadata, results)
            os.kill(os.getpid(), signal.SIGKILL)

    dcp.save(_tensors(), storage_writer=Dying(path), no_dist=True)


def write(path: str) -> dict[str, Any]:
    """A whole small checkpoint (the killed writer's state dict), in this process."""
    import torch.distributed.checkpoint as dcp

    state = _tensors()
    dcp.save(state, checkpoint_id=path, no_dist=True)
    return state
