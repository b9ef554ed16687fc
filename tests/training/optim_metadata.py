"""The `.metadata` a multi-rank DCP save of an Adam-like optimizer state writes: built from DCP's own
dataclasses and pickled as DCP pickles it, without saving any tensor (bench/bench_pickle_depth.py times
the one of 102,400 chunks)."""

from __future__ import annotations

import pickle
from pathlib import PosixPath

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)


def optim_metadata(chunks: int, ranks: int = 2) -> Metadata:
    """`chunks` tensor chunks: each tensor (an exp_avg or exp_avg_sq) split across `ranks` along dim 0."""
    rows, cols, record = 1024, 256, 1024 * 256 * 4 + 1577
    sd: dict = {}
    planner: dict = {}
    storage: dict = {}
    ends = [0] * ranks
    for t in range(chunks // ranks):
        param, moment = f"model.layers.{t // 2}.mlp.w{t % 7}.weight", ("exp_avg", "exp_avg_sq")[t % 2]
        fqn = f"state.{param}.{moment}"
        parts = [
            ChunkStorageMetadata(torch.Size([r * rows, 0]), torch.Size([rows, cols])) for r in range(ranks)
        ]
        sd[fqn] = TensorStorageMetadata(
            TensorProperties(dtype=torch.float32), torch.Size([ranks * rows, cols]), parts
        )
        planner[fqn] = ("state", param, moment)
        for r, part in enumerate(parts):
            storage[MetadataIndex(fqn, part.offsets, r)] = _StorageInfo(f"__{r}_0.distcp", ends[r], record)
            ends[r] += record
    for key in ("lr", "betas", "weight_decay"):
        fqn = f"param_groups.0.{key}"
        sd[fqn] = BytesStorageMetadata()
        planner[fqn] = ("param_groups", 0, key)
        storage[MetadataIndex(fqn)] = _StorageInfo("__0_0.distcp", ends[0], 1261)
        ends[0] += 1261
    meta = StorageMeta(checkpoint_id=PosixPath("/ckpt/step-00000001/optim"), save_id="5b1c8f9e", modules=[])
    return Metadata(sd, planner_data=planner, storage_data=storage, storage_meta=meta, version="1.0.0")


def optim_metadata_bytes(chunks: int, ranks: int = 2) -> bytes:
    return pickle.dumps(optim_metadata(chunks, ranks))  # DCP's FileSystemWriter: pickle.dump(metadata, f)
