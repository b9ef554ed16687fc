"""Real multi-process gloo DCP saves for the tests: HuggingFaceStorageWriter(save_distributed=True).

Every rank builds the same full tensors from a seed, takes its DTensor block without communication
(gloo cannot scatter fp8 or bool) and lets DCP write its shard. The parent rebuilds the same full tensors
to compare against.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from stagerd.contract import commit_marker, layout
from tests.gloo import join, launch

Spec = dict[str, tuple[torch.Tensor, str]]  # name -> (full tensor, placement code)

# Placement codes: "R" replicate, "S0"/"S1"/"S2" shard a dim over a 1-D mesh of all ranks,
# "B01" 2-D mesh block (Shard(0), Shard(1)) over a (2, world/2) mesh, "L" a plain local tensor.


def mixed_tensors(seed: int = 0) -> Spec:
    """Every case the export engine must handle, small."""
    g = torch.Generator().manual_seed(seed)

    def rn(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dtype)

    def ri(*shape: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.randint(-100, 100, shape, generator=g).to(dtype)

    return {
        "model.embed_tokens.weight": (rn(37, 16), "S0"),
        "model.layers.0.self_attn.q_proj.weight": (rn(16, 16, dtype=torch.bfloat16), "S0"),
        "model.layers.0.self_attn.o_proj.weight": (rn(16, 13), "S1"),
        "model.layers.0.mlp.up_proj.weight": (rn(12, 10, dtype=torch.float16), "B01"),
        "model.layers.0.input_layernorm.weight": (rn(16), "R"),
        "model.layers.1.mlp.gate.weight": (rn(5, 16, dtype=torch.float64), "S0"),
        "model.layers.2.conv.weight": (rn(6, 3, 4, 5), "S2"),
        "model.layers.10.mlp.down_proj.weight": (rn(3, 2), "S0"),
        "model.layers.10.scale": (torch.tensor(1.25), "L"),
        "model.step_count": (torch.tensor(7, dtype=torch.int64), "R"),
        "model.ids_i8": (ri(9, dtype=torch.int8), "S0"),
        "model.ids_u8": (ri(9, dtype=torch.int16).abs().to(torch.uint8), "S0"),
        "model.ids_i16": (ri(4, 3, dtype=torch.int16), "S1"),
        "model.ids_i32": (ri(11, dtype=torch.int32), "S0"),
        "model.ids_i64": (ri(3, 5, dtype=torch.int64), "B01"),
        "model.mask": (torch.rand(7, 3, generator=g) > 0.5, "S0"),
        "model.fp8_e4m3": (rn(8, 4).to(torch.float8_e4m3fn), "S0"),
        "model.fp8_e5m2": (rn(4, 6).to(torch.float8_e5m2), "S1"),
        "lm_head.weight": (rn(37, 16), "S0"),
    }


def big_tensors() -> Spec:
    """`mixed_tensors` plus one 34 MB tensor: its export file goes to S3 as a 3-part multipart upload."""
    g = torch.Generator().manual_seed(5)
    return {**mixed_tensors(), "model.big.weight": (torch.randn(2100, 4096, generator=g), "S0")}


def _local_block(full: torch.Tensor, code: str, mesh) -> tuple[torch.Tensor, list]:
    from torch.distributed.tensor import Replicate, Shard

    if code == "R":
        return full, [Replicate()]
    if code.startswith("S"):
        d = int(code[1:])
        placements = [Shard(d)]
    else:
        placements = [Shard(0), Shard(1)]
    local = full
    coords = mesh.get_coordinate()
    for mesh_dim, p in enumerate(placements):
        n = mesh.size(mesh_dim)
        chunks = list(torch.chunk(local, n, dim=p.dim))
        c = coords[mesh_dim]
        if c < len(chunks):
            local = chunks[c]
        else:
            shape = list(local.shape)
            shape[p.dim] = 0
            local = local.new_empty(shape)
    return local.contiguous(), placements


def _rank_main(rank: int, world: int, init_file: str, out: str, builder: Callable[[], Spec]) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    join(rank, world, init_file)
    try:
        mesh1 = init_device_mesh("cpu", (world,))
        mesh2 = init_device_mesh("cpu", (2, world // 2)) if world % 2 == 0 else None
        sd = {}
        for name, (full, code) in builder().items():
            if code == "L":
                sd[name] = full
                continue
            mesh = mesh2 if code == "B01" else mesh1
            if mesh is None:
                raise ValueError("B01 placements need an even world size")
            local, placements = _local_block(full, code, mesh)
            sd[name] = DTensor.from_local(
                local, mesh, placements, run_check=False, shape=full.shape, stride=full.stride()
            )
        dcp.save(sd, storage_writer=HuggingFaceStorageWriter(out, save_distributed=True))
    finally:
        dist.destroy_process_group()


def dcp_save(
    out: Path, world: int = 4, builder: Callable[[], Spec] = mixed_tensors
) -> dict[str, torch.Tensor]:
    """Save `builder()`'s tensors with `world` gloo processes into `out`; return the full tensors."""
    out.mkdir(parents=True, exist_ok=True)
    launch(_rank_main, str(out), builder, world=world)
    return {k: v for k, (v, _) in builder().items()}


def commit_step(step_dir: Path, world: int, **marker_fields) -> commit_marker.CommitMarker:
    """Write a commit marker listing every file under step_dir, as the Stager would."""
    files = tuple(
        commit_marker.StagedFile(str(p.relative_to(step_dir)), p.stat().st_size)
        for p in sorted(step_dir.rglob("*"))
        if p.is_file() and p.name != layout.MARKER_NAME
    )
    marker = commit_marker.CommitMarker(
        step=layout.parse_step_dir(step_dir.name) or 0,
        world_size=world,
        files=files,
        **{"created": time.time(), **marker_fields},  # a node-local save's markers share rank 0's time
    )
    commit_marker.write_marker(step_dir, marker)
    return marker


if __name__ == "__main__":
    t = dcp_save(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 4)
    print(f"saved {len(t)} tensors")


def float_tensors() -> Spec:
    """The fp32/bf16 subset of `mixed_tensors`: what torch's own consolidation can handle."""
    return {k: v for k, v in mixed_tensors(3).items() if v[0].dtype in {torch.float32, torch.bfloat16}}
