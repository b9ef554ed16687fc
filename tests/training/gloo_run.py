"""What the Stager's multi-process tests share: a small sharded model and the outcome of a save (the
ranks are started by `tests.gloo`).

"""

from __future__ import annotations

import json
from pathlib import Path

import torch

WORLD = 2
SLOW_NUMEL = 8 << 20  # 32 MiB fp32 held by rank 1 alone: its shard is written well after rank 0's


def params(world: int) -> dict[str, tuple[torch.Tensor, str]]:
    """name -> (initial full tensor, placement): "S0"/"S1" shard a dim, "R" replicate."""
    g = torch.Generator().manual_seed(7)
    return {
        "model.embed_tokens.weight": (torch.randn(37, 16, generator=g), "S0"),
        "model.layers.0.self_attn.q_proj.weight": (torch.randn(16, 16, generator=g).bfloat16(), "S0"),
        "model.layers.0.mlp.up_proj.weight": (torch.randn(12, 10, generator=g).half(), "S1"),
        "model.norm.weight": (torch.randn(16, generator=g), "R"),
        "lm_head.weight": (torch.randn(37, 16, generator=g), "S0"),
    }


def slow_tensor() -> torch.Tensor:
    return torch.arange(SLOW_NUMEL, dtype=torch.float32)


def dtensors(world: int, rank: int) -> dict[str, torch.Tensor]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    mesh = init_device_mesh("cpu", (world,))
    sd = {}
    for name, (full, code) in params(world).items():
        if code == "R":
            local, placements = full.clone(), [Replicate()]
        else:
            d = int(code[1:])
            local, placements = torch.chunk(full, world, dim=d)[rank].clone().contiguous(), [Shard(d)]
        sd[name] = DTensor.from_local(
            local, mesh, placements, run_check=False, shape=full.shape, stride=full.stride()
        )
    return sd


def train_step(sd: dict[str, torch.Tensor], step: int) -> None:
    """Change every sharded parameter in place, as an optimizer step would."""
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        for t in sd.values():
            if isinstance(t, DTensor):
                t.to_local().mul_(0.5).add_(float(step))


def local_nbytes(t: torch.Tensor) -> int:
    return (t.to_local() if hasattr(t, "to_local") else t).untyped_storage().nbytes()


def full_state(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.full_tensor().contiguous() for k, v in sd.items()}  # collective


def record(out: Path, rank: int, rec: dict) -> None:
    (out / f"rank{rank}.json").write_text(json.dumps(rec))


def attempt(stager, *args, **kwargs) -> dict:
    """Save, then record what save(), wait_staged(), the handle and wait() each said."""
    from stagerd.errors import SaveError

    out: dict[str, str | None] = {"save": None, "staged": None, "handle": None, "wait": None}
    try:
        handle = stager.save(*args, **kwargs)
    except SaveError as e:
        out["save"] = str(e)
        handle = None
    if handle is not None:
        try:
            handle.wait_staged()
        except SaveError as e:
            out["staged"] = str(e)
        try:
            handle.result()
        except SaveError as e:
            out["handle"] = str(e)
    try:
        stager.wait()
    except SaveError as e:
        out["wait"] = str(e)
    return out


def attempt_result(handle) -> str | None:
    from stagerd.errors import SaveError

    try:
        handle.result()
    except SaveError as e:
        return str(e)
    return None
