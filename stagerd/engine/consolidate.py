"""DCP shards -> HF safetensors in one call: `scan_shards` -> `plan` -> `execute` -> the index.

The plan is frozen before a byte moves, and both the file headers and the index are derived from it, so the
index can never disagree with the files. Memory is a fixed set of per-thread buffers: it does not grow with
the model or its largest tensor. The pieces live one job per module:

- `shard_scan`: find and validate the shards; `planner`: `plan()`, with `tiling` and `moves` under it;
- `plan_types`: the frozen plan; `runner`: threads and buffers; `cast`: the numpy cast kernel;
- `durability`: fallocate, writeback and fsync; `execute`: `execute()` and `compare()`.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from stagerd.contract.commit_marker import TensorInfo
from stagerd.contract.hub_plan import HubPlan
from stagerd.contract.layout import INDEX_NAME, write_bytes_atomic
from stagerd.contract.progress_fn import ProgressFn
from stagerd.contract.safetensors_format import Header
from stagerd.contract.sharding import DEFAULT_MAX_SHARD_SIZE
from stagerd.engine.execute import compare, execute, output_error
from stagerd.engine.index_json import index_json
from stagerd.engine.merge import lora_merges
from stagerd.engine.plan_types import ExportPlan, Move, MoveKind
from stagerd.engine.planner import plan
from stagerd.engine.shard_scan import scan_shards


@dataclass(frozen=True)
class ConsolidateResult:
    """The safetensors files written (name, size), the tensor count and bytes, the index (name, size)
    where there is one, and the bytes written per output dtype (safetensors name)."""

    files: tuple[tuple[str, int], ...]
    tensors: int
    total_size: int
    index: tuple[str, int] | None
    dtype_bytes: tuple[tuple[str, int], ...] = ()
    named_dtype: str | None = None


def consolidate_into(
    src: Path,
    out_dir: Path,
    *,
    listed: Iterable[str] | None = None,
    dtype: str | None = None,
    keep_dtype: str | None = None,
    reference: Mapping[str, str] | None = None,
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
    expected: Mapping[str, TensorInfo] | None = None,
    views: HubPlan | None = None,
    threads: int = 2,
    progress: ProgressFn | None = None,
    scan: Callable[[], Iterable[Header]] | None = None,
    scratch_parent: Path | None = None,
) -> ConsolidateResult:
    """Plan from the shards in `src` and write the safetensors files into `out_dir`, as save_pretrained
    does: `model.safetensors` alone when they fit one file, else the numbered files and their index.

    `scan` gives the source's validated headers when they are not `src`'s DCP safetensors shards (an
    adopted FileSystemWriter checkpoint: `engine/adopt/`). `scratch_parent`: where a LoRA merge's scratch
    goes, default beside `out_dir` (an `out_dir` given as a held directory's /proc path has no parent)."""
    headers = scan if scan is not None else lambda: scan_shards(src, listed)
    # A to-Hub plan's LoRA merges are computed first, into a scratch shard beside out_dir (engine/merge.py).
    scratch = out_dir.parent if scratch_parent is None else scratch_parent
    with lora_merges(headers(), views, expected, scratch) as (merged, expected):
        p = plan(
            itertools.chain(headers(), merged),
            dtype=dtype,
            keep_dtype=keep_dtype,
            reference=reference,
            max_shard_size=max_shard_size,
            expected=expected,
            views=views,
        )
        execute(p, out_dir, threads=threads, progress=progress)
    written = None
    if p.has_index:
        index = out_dir / INDEX_NAME
        try:
            write_bytes_atomic(index, index_json(p))
            written = (INDEX_NAME, index.stat().st_size)
        except OSError as e:
            raise output_error(e, index) from None
    return ConsolidateResult(
        tuple((f.name, f.size) for f in p.files),
        p.tensor_count,
        p.total_size,
        written,
        p.dtype_bytes(),
        p.named_dtype,
    )


__all__ = [
    "ConsolidateResult",
    "ExportPlan",
    "Move",
    "MoveKind",
    "compare",
    "consolidate_into",
    "execute",
    "plan",
    "scan_shards",
]
