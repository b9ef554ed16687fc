"""What each gloo rank of `test_adopt_shards.py` runs: a tiny Llama under FSDP2 saved by a plain `dcp.save`
of `{"model": ...}` into `ROOT/step-1`, nothing of stagerd's; rank 0 then writes config.json beside it and
`save_pretrained` of the gathered weights at a small max shard size, kept and in bf16, as the reference."""

from __future__ import annotations

from pathlib import Path

from tests.fidelity import models
from tests.gloo import join

MAX_SHARD = 5000  # bytes: the tiny model in many files


def dcp_save(rank: int, world: int, init_file: str, root: str, ref: str, kind: str) -> None:
    join(rank, world, init_file)
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = models.build(kind)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=str(Path(root) / "step-1"))
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        torch.manual_seed(0)
        plain = models.build(kind)
        plain.load_state_dict(full)
        plain.save_pretrained(Path(ref) / "keep", max_shard_size=MAX_SHARD)
        plain.to(torch.bfloat16).save_pretrained(Path(ref) / "bf16", max_shard_size=MAX_SHARD)
        (Path(root) / "step-1" / "config.json").write_bytes((Path(ref) / "keep" / "config.json").read_bytes())
