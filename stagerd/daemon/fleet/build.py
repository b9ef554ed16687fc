"""One artefact of a fleet step, planned on the mirror as one daemon plans it, built file by file.

An artefact is the main export or a PEFT model's adapter (`export/adapter/adapter_model.safetensors`, one
file, planned as `engine.export` plans it). Its to-Hub plan's LoRA merges are arithmetic on whole tensors,
so they are not byte moves the mirror can fetch for: every node writes the merges' scratch shard header
(`merge.write_scratch_header`, the same bytes one daemon writes) and plans with it, so the plan, the owners
and every output byte are one daemon's. Only a node that builds a file reading a merged tensor computes
that merge, after fetching its base, A and B blocks into the mirror (`merge.merge_reads`): the whole of
those three tensors, from whichever nodes staged them, and nothing else.
"""

from __future__ import annotations

import itertools
import shutil
from collections.abc import Mapping
from pathlib import Path

from stagerd.contract.commit_marker import TensorInfo
from stagerd.contract.hub_plan import HubPlan
from stagerd.contract.progress_fn import ProgressFn
from stagerd.contract.safetensors_format import Header
from stagerd.daemon.fleet.plan import Mirror, only_file, reads
from stagerd.engine.chunk_table import build_chunk_table
from stagerd.engine.execute import execute
from stagerd.engine.merge import merge_into, merge_reads, with_merged, write_scratch_header
from stagerd.engine.plan_types import ExportPlan, OutputFile
from stagerd.engine.planner import plan
from stagerd.engine.shard_scan import scan_shards


class Artefact:
    """The plan of `views` over every shard in `mirror`, with its merges' scratch shard at `scratch`."""

    def __init__(
        self,
        mirror: Mirror,
        listed: list[str],
        scratch: Path,
        views: HubPlan | None,
        *,
        dtype: str | None,
        keep_dtype: str | None,
        reference: Mapping[str, str] | None,
        max_shard_size: int,
        expected: Mapping[str, TensorInfo] | None,
    ) -> None:
        self.mirror = mirror
        self.merges = list(views.merges) if views is not None else []
        self.done: set[str] = set()
        self.scratch = scratch
        more: list[Header] = []
        zeros = views.zeros if views is not None else ()
        if self.merges or zeros:  # zero fills are holes of the same scratch shard: nothing to fetch
            self.table, self.ids = build_chunk_table(scan_shards(mirror.model, listed))
            shutil.rmtree(scratch.parent, ignore_errors=True)  # a killed run's
            scratch.parent.mkdir(parents=True)
            self.header = write_scratch_header(self.table, self.ids, self.merges, scratch, zeros=zeros)
            more = [self.header]
            expected = with_merged(expected, self.header)
        self.plan: ExportPlan = plan(
            itertools.chain(scan_shards(mirror.model, listed), more),
            dtype=dtype,
            keep_dtype=keep_dtype,
            reference=reference,
            max_shard_size=max_shard_size,
            expected=expected,
            views=views,
        )

    @property
    def files(self) -> tuple[OutputFile, ...]:
        return self.plan.files

    def build(self, name: str, out: Path, *, threads: int, progress: ProgressFn | None) -> ExportPlan:
        """Write output file `name` into `out` after fetching (and merging) what it reads; its plan."""
        sub = only_file(self.plan, name)
        self._merge(sub)
        self.mirror.fill(reads(sub))
        execute(sub, out, threads=threads, progress=progress)
        return sub

    def _merge(self, sub: ExportPlan) -> None:
        """Compute the merges whose merged tensor `sub` reads and this run has not computed yet."""
        if not self.merges:
            return
        spans = [(off, off + n) for src, off, n in reads(sub) if src == str(self.scratch) and n]
        start = self.header.data_start
        need = []
        for m in self.merges:
            e = self.header.tensors[m.name]
            a, b = start + e.begin, start + e.end
            if m.name not in self.done and any(x < b and a < y for x, y in spans):
                need.append(m)
        for m in need:
            self.mirror.fill(merge_reads(self.table, self.ids, m))
        merge_into(self.table, self.ids, need, self.scratch, self.header)
        self.done.update(m.name for m in need)
