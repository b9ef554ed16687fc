"""A to-Hub plan's zero fills carried out by the engine (engine/merge.py's scratch shard): padding rows or
columns of sharded tensors of several dtypes, kept and cast, re-derived byte for byte by `compare`; the
fills are holes of a sparse file, read as zeros and never written to disk."""

from __future__ import annotations

import itertools
import os

import pytest
import torch
from safetensors.torch import load_file

from stagerd.contract.dtypes import safetensors_name
from stagerd.contract.hub_plan import HubPlan, TensorView, ZeroFill
from stagerd.engine import merge
from stagerd.engine.chunk_table import build_chunk_table
from stagerd.engine.consolidate import compare, consolidate_into, plan
from stagerd.engine.shard_scan import scan_shards
from stagerd.errors import HubPlanError

# name -> (output, dim padded, rows or columns of zeros)
PADS = {
    "lm_head.weight": ("lm_head.padded", 0, 3),  # F32, sharded by rows
    "model.layers.0.self_attn.o_proj.weight": ("o_proj.padded", 1, 3),  # F32, sharded by columns
    "model.layers.0.self_attn.q_proj.weight": ("q_proj.padded", 0, 2),  # BF16
    "model.ids_i32": ("ids.padded", 0, 5),  # an integer tensor: never cast
}


def padded_plan(full: dict[str, torch.Tensor]) -> HubPlan:
    views, zeros = [], []
    for name, (out, dim, n) in PADS.items():
        shape = tuple(full[name].shape)
        pad = tuple(n if d == dim else s for d, s in enumerate(shape))
        whole = tuple(s + (n if d == dim else 0) for d, s in enumerate(shape))
        z = ZeroFill(f"{out}#zeros0", safetensors_name(full[name].dtype), pad)
        zeros.append(z)
        at = tuple(shape[d] if d == dim else 0 for d in range(len(shape)))
        origin = (0,) * len(shape)
        views.append(TensorView(out, name, origin, shape, shape, at=origin, whole=whole))
        views.append(TensorView(out, z.name, (0,) * len(pad), pad, pad, at=at, whole=whole))
    return HubPlan(tuple(views), (), "test", zeros=tuple(zeros))


@pytest.mark.parametrize("dtype", [None, "BF16"])
def test_zero_padding_is_written_as_the_padded_tensor(tmp_path, dcp_mixed2, dtype):
    src, full = dcp_mixed2
    hub = padded_plan(full)
    out = tmp_path / "out"
    out.mkdir()
    res = consolidate_into(src, out, views=hub, dtype=dtype)
    got: dict[str, torch.Tensor] = {}
    for name, _ in res.files:
        got.update(load_file(out / name))
    for name, (padded, dim, n) in PADS.items():
        t = full[name]
        shape = list(t.shape)
        shape[dim] = n
        want = torch.cat([t, torch.zeros(shape, dtype=t.dtype)], dim=dim)
        if dtype is not None and t.is_floating_point():
            want = want.to(torch.bfloat16)
        assert got[padded].dtype == want.dtype and torch.equal(got[padded], want), padded
        assert name not in got  # read by its padded view only
    assert not any(k.endswith("#zeros0") for k in got)  # a zero fill is never written as itself
    assert not any(p.name.startswith(merge.MERGE_SCRATCH_PREFIX) for p in tmp_path.iterdir())
    # verify's way: the same plan re-derived from the shards, every byte compared
    with merge.lora_merges(scan_shards(src), hub, None, None) as (scratch, _):
        p = plan(itertools.chain(scan_shards(src), scratch), views=hub, dtype=dtype)
        compare(p, out)


def test_the_scratch_shard_holds_zero_fills_as_holes(tmp_path, dcp_mixed2):
    src, _ = dcp_mixed2
    table, ids = build_chunk_table(scan_shards(src))
    big = ZeroFill("pad#zeros0", "F32", (4096, 4096))  # 64 MiB of zeros
    path = tmp_path / merge.SCRATCH_NAME
    header = merge.write_scratch_header(table, ids, [], path, zeros=[big])
    e = header.tensors[big.name]
    assert e.end - e.begin == 64 << 20 and os.path.getsize(path) >= 64 << 20
    assert os.stat(path).st_blocks * 512 < 1 << 20  # sparse: no data blocks on disk
    with open(path, "rb") as f:
        f.seek(header.data_start + e.begin + (32 << 20))
        assert f.read(1 << 16) == bytes(1 << 16)


def test_a_zero_fill_the_checkpoint_contradicts_is_a_named_error(tmp_path, dcp_mixed2):
    src, full = dcp_mixed2
    bad = {
        "would replace": ZeroFill("lm_head.weight", "F32", (1, 16)),  # a staged tensor's name
        "unknown dtype": ZeroFill("x#zeros0", "F33", (1,)),
        "not whole bytes": ZeroFill("x#zeros0", "F4", (3,)),
    }
    for words, z in bad.items():
        (tmp_path / words).mkdir()
        with pytest.raises(HubPlanError, match=words):
            consolidate_into(src, tmp_path / words, views=HubPlan(zeros=(z,)))
    with pytest.raises(HubPlanError, match="was not made"):  # planned without the engine's scratch shard
        plan(scan_shards(src), views=padded_plan(full))
