"""The to-Hub plan carried out by the engine (engine/views.py): every output is a box of one staged
tensor, cut from blocks sharded along any dim or a 2-D mesh, copied or cast, compared with torch slicing."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file

from stagerd.contract.hub_plan import HubPlan, SharedStorage, TensorView
from stagerd.engine.consolidate import consolidate_into
from stagerd.engine.planner import plan
from stagerd.engine.shard_scan import scan_shards
from stagerd.errors import HubPlanError
from tests.dcp_fixtures import Spec, dcp_save
from tests.export_index import export_index

pytestmark = pytest.mark.slow


def fused() -> Spec:
    g = torch.Generator().manual_seed(3)
    return {
        "experts.gate_up": (torch.randn(5, 6, 4, generator=g), "S0"),  # FSDP2: experts split by rank
        "experts.down": (torch.randn(5, 4, 3, generator=g).bfloat16(), "S1"),
        "qkv": (torch.randn(12, 8, generator=g), "B01"),  # a 2-D mesh block
        "norm": (torch.randn(8, generator=g), "R"),
        "tied": (torch.randn(6, 8, generator=g), "S0"),
    }


def view(name: str, source: str, start, size, shape=None) -> TensorView:
    sz = tuple(size)
    out = tuple(shape) if shape else tuple(n for n in sz if n != 1)
    return TensorView(name, source, tuple(start), sz, out)


def hub_plan() -> HubPlan:
    views = []
    for e in range(5):
        views.append(view(f"experts.{e}.gate", "experts.gate_up", (e, 0, 0), (1, 3, 4)))
        views.append(view(f"experts.{e}.up", "experts.gate_up", (e, 3, 0), (1, 3, 4)))
        views.append(view(f"experts.{e}.down", "experts.down", (e, 0, 0), (1, 4, 3)))
    for i, part in enumerate("qkv"):
        views.append(view(f"{part}_proj", "qkv", (4 * i, 0), (4, 8)))
    views.append(view("cols", "qkv", (0, 2), (12, 3)))  # inside rows: one run per row
    # The RoPE row order of a key mapping: rows (h, i, pair) -> (h, pair, i), across the 2-D mesh's blocks
    views.append(TensorView("rope_all", "qkv", (0, 0), (12, 8), (12, 8), (2, 3, 2, 8), (0, 2, 1, 3)))
    views.append(TensorView("rope_k", "qkv", (4, 0), (4, 8), (4, 8), (1, 2, 2, 8), (0, 2, 1, 3)))
    # A merge: parts of several staged tensors concatenated into one output, one part a RoPE permutation
    views.append(TensorView("fused", "tied", (0, 0), (6, 8), (6, 8), at=(0, 0), whole=(14, 8)))
    views.append(
        TensorView("fused", "qkv", (0, 0), (8, 8), (8, 8), (2, 2, 2, 8), (0, 2, 1, 3), (6, 0), (14, 8))
    )
    # Transposes (a registry Transpose): a whole 2-D mesh tensor, and one expert of a Shard(1) bf16 tensor
    views.append(TensorView("qkv_t", "qkv", (0, 0), (12, 8), (8, 12), (12, 8), (1, 0)))
    views.append(TensorView("down_t.2", "experts.down", (2, 0, 0), (1, 4, 3), (3, 4), (4, 3), (1, 0)))
    views.append(view("tied", "tied", (0, 0), (6, 8)))
    views.append(view("lm_head", "tied", (0, 0), (6, 8)))
    return HubPlan(tuple(views), drop=("norm",), origin="transformers")


def expected(full: dict[str, torch.Tensor], hub: HubPlan) -> dict[str, torch.Tensor]:
    out = {}
    for v in hub.views:
        box = tuple(slice(a, a + n) for a, n in zip(v.start, v.size, strict=True))
        part = full[v.source][box]
        if v.perm:
            part = part.reshape(v.reshape).permute(v.perm)
        if v.at:
            whole = out.setdefault(v.name, torch.zeros(v.whole, dtype=part.dtype))
            whole[tuple(slice(a, a + n) for a, n in zip(v.at, v.shape, strict=True))] = part.reshape(v.shape)
            continue
        out[v.name] = part.reshape(v.shape)
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    src = tmp_path_factory.mktemp("views") / "shards"
    return src, dcp_save(src, world=4, builder=fused)


@pytest.mark.parametrize("dtype", [None, "BF16"])
def test_every_view_is_the_box_torch_slices(tmp_path, saved, dtype):
    src, full = saved
    hub = hub_plan()
    (tmp_path / "out").mkdir()
    res = consolidate_into(src, tmp_path / "out", views=hub, dtype=dtype, max_shard_size=600)
    got: dict[str, torch.Tensor] = {}
    for name, _ in res.files:
        got.update(load_file(tmp_path / "out" / name))
    want = expected(full, hub)
    assert sorted(got) == sorted(want)  # "norm" dropped; "tied" and "lm_head" each with its own bytes
    for name, t in want.items():
        t = t if dtype is None or not t.is_floating_point() else t.to(torch.bfloat16)
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name
    index = export_index(tmp_path / "out")
    assert sorted(index["weight_map"]) == sorted(want)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in got.values())


def test_a_plan_the_checkpoint_contradicts_is_a_named_error_before_any_output(saved):
    src, _ = saved
    bad = {
        "which was not saved": HubPlan((view("x", "nope", (0,), (8,)),)),
        "two tensors are named": HubPlan((view("norm", "tied", (0, 0), (1, 8)),)),
        "outside": HubPlan((view("x", "tied", (4, 0), (3, 8)),)),
        "is not its box": HubPlan((view("x", "tied", (0, 0), (6, 8), (8, 6, 2)),)),
        "drops": HubPlan((), drop=("nope",)),
        # before: written as [1, 1] holding 4 of its bytes; a transpose of garbage
        "shape .-8, -6. is negative": HubPlan(
            (TensorView("x", "tied", (0, 0), (6, 8), (-8, -6), (6, 8), (1, 0)),)
        ),
        "reshape .-8, -6. is negative": HubPlan(
            (TensorView("x", "tied", (0, 0), (6, 8), (8, 6), (-8, -6), (1, 0)),)
        ),
        "save order does not name exactly": HubPlan((), order=("tied", "qkv")),
        "shared storage of the plan names": HubPlan(
            (), order=tuple(fused()), shared=(SharedStorage(("nope",), 3),)
        ),
        # before: `tied` in no file (it follows `norm`, which follows `qkv`): exported without it, no error
        "two shared storages of the plan hold 'norm'": HubPlan(
            (),
            order=tuple(fused()),
            shared=(SharedStorage(("tied", "norm"), 200), SharedStorage(("norm", "qkv"), 200)),
        ),
        "two shared storages of the plan hold 'tied'": HubPlan(
            (), order=tuple(fused()), shared=(SharedStorage(("tied", "tied"), 200),)
        ),
        # before: packed by 4 bytes for 192; now it would be the index's total_size too
        "shared storage of the plan is smaller than 'tied'": HubPlan(
            (), order=tuple(fused()), shared=(SharedStorage(("tied", "norm"), 1),)
        ),
    }
    for words, hub in bad.items():
        with pytest.raises(HubPlanError, match=words):
            plan(scan_shards(src), views=hub)


def test_the_plan_round_trips_through_the_marker_json():
    hub = hub_plan()
    assert HubPlan.from_json(json.loads(json.dumps(hub.to_json()))) == hub
    split = replace(hub, order=("b", "a"), shared=(SharedStorage(("a", "b"), 7),), parameters=12)
    assert HubPlan.from_json(json.loads(json.dumps(split.to_json()))) == split
    for bad in ({"views": [{"name": 1}]}, {"views": [], "order": "ab"}, {"views": [], "parameters": -1}):
        with pytest.raises(HubPlanError, match="malformed"):
            HubPlan.from_json({"format": "stagerd.hub/1", **bad})


def test_a_plan_with_a_save_order_fills_files_as_save_pretrained(tmp_path, saved):
    """The plan's order, shared storages and parameter count (save_pretrained's state dict walk, a split's
    views of one storage, num_parameters()): files filled as its splitter fills them, and its index."""
    src, _ = saved
    order = ("tied", "norm", "qkv", "experts.down", "experts.gate_up")
    hub = HubPlan((), order=order, shared=(SharedStorage(("norm", "experts.down"), 100),), parameters=5)
    out = tmp_path / "out"
    out.mkdir()
    consolidate_into(src, out, views=hub, max_shard_size=300)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_parameters"] == 5
    # tied (192 B) opens a file; norm, sized as its storage (100 F32 elements: 400 B), and qkv (384 B) and
    # experts.gate_up (480 B) are each over the limit: a file of their own, ahead of tied's; experts.down
    # joins norm, whose storage it shares.
    assert index["weight_map"] == {
        "experts.down": "model-00001-of-00004.safetensors",
        "experts.gate_up": "model-00003-of-00004.safetensors",
        "norm": "model-00001-of-00004.safetensors",
        "qkv": "model-00002-of-00004.safetensors",
        "tied": "model-00004-of-00004.safetensors",
    }


def test_a_marker_plan_the_shards_contradict_publishes_nothing(tmp_path, saved):
    """Caught at export time (a marker written by hand, or by another trainer): named, nothing published."""
    import shutil

    from stagerd.contract import layout
    from tests.cli_helpers import run_cli
    from tests.daemon_helpers import fast_flags
    from tests.dcp_fixtures import commit_step

    src, _ = saved
    step = tmp_path / "root" / layout.step_dir_name(1)
    shutil.copytree(src, step / layout.MODEL_DIR)
    commit_step(
        step, 4, hub_plan=HubPlan((view("x", "tied", (0, 0), (6, 8)), view("x", "qkv", (0, 0), (6, 8))))
    )
    res = run_cli(
        ["watch", tmp_path / "root", "--sink", f"file://{tmp_path / 'sink'}", "--once", *fast_flags()]
    )
    assert res.returncode != 0
    assert (
        "HubPlanError" in res.stdout + res.stderr and "two tensors are named 'x'" in res.stdout + res.stderr
    )
    assert not (tmp_path / "sink" / layout.step_dir_name(1)).exists()
    assert not (step / layout.EXPORT_DIR).exists()


def _mapping(sizes):
    split = [{"name": f"{p}_proj", "size": n} for p, n in zip("qkv", sizes, strict=True)]
    split[0]["rope_heads"] = 1
    return {
        "rules": [{"match": "qkv", "split_dim": 0, "split": split}, {"match": "norm", "name": "model.norm"}]
    }


def test_watch_applies_a_key_mapping_to_a_step_saved_without_a_plan(tmp_path, saved):
    """`watch --mapping`: the daemon resolves the mapping against the marker's tensors; a mapping that does
    not fit (split sizes not adding up) is a named error and nothing is published."""
    import shutil

    from safetensors.torch import load_file as load

    from stagerd.contract import commit_marker, layout
    from stagerd.contract.dtypes import safetensors_name
    from tests.cli_helpers import run_cli
    from tests.daemon_helpers import fast_flags
    from tests.dcp_fixtures import commit_step

    src, full = saved
    tensors = {
        k: commit_marker.TensorInfo(safetensors_name(t.dtype), tuple(t.shape)) for k, t in full.items()
    }
    results = {}
    for case, sizes in (("good", (4, 4, 4)), ("bad", (4, 4, 3))):
        root, sink, mapping = tmp_path / case, tmp_path / f"sink-{case}", tmp_path / f"{case}.json"
        shutil.copytree(src, root / layout.step_dir_name(1) / layout.MODEL_DIR)
        commit_step(root / layout.step_dir_name(1), 4, tensors=tensors)
        mapping.write_text(json.dumps(_mapping(sizes)))
        argv = ["watch", root, "--sink", f"file://{sink}", "--once", "--mapping", mapping, *fast_flags()]
        results[case] = (run_cli(argv), sink / layout.step_dir_name(1))
    res, out = results["good"]
    assert res.returncode == 0, res.stdout + res.stderr
    got = {}
    for f in out.glob("*.safetensors"):
        got.update(load(f))
    rope = full["qkv"][:4].reshape(1, 2, 2, 8).permute(0, 2, 1, 3).reshape(4, 8)
    want = {"q_proj": rope, "k_proj": full["qkv"][4:8], "v_proj": full["qkv"][8:], "model.norm": full["norm"]}
    for name, t in want.items():
        assert torch.equal(got.pop(name), t), name
    assert sorted(got) == ["experts.down", "experts.gate_up", "tied"]  # unmapped keys kept as they are
    res, out = results["bad"]
    assert res.returncode != 0 and "add up to 11, not its dim 0 of 12" in res.stdout + res.stderr
    assert not out.exists()


def big_transposes() -> Spec:
    g = torch.Generator().manual_seed(4)
    return {
        "w": (torch.randn(3, 40, 24, generator=g), "S0"),
        "m": (torch.randn(36, 20, generator=g).bfloat16(), "S1"),
    }


@pytest.fixture(scope="module")
def transposes_saved(tmp_path_factory):
    src = tmp_path_factory.mktemp("transposes") / "shards"
    return src, dcp_save(src, world=2, builder=big_transposes)


@pytest.mark.parametrize("buffer", [1 << 20, 1024, 96])  # whole tensors; bands and runs; one run split
@pytest.mark.parametrize("dtype", [None, "BF16"])
def test_transposes_are_copied_in_tiles_with_bounded_buffers(
    tmp_path, monkeypatch, transposes_saved, buffer, dtype
):
    """engine/strided.py: a transposed block is read in spans, bands or packed runs, never more than the
    buffer at once, and placed tile-wise; every byte as torch transposes it."""
    from stagerd.engine import limits, strided

    src, full = transposes_saved
    monkeypatch.setattr(limits, "BUFFER_BYTES", buffer)
    monkeypatch.setattr(strided, "MIN_RUN", 16)  # so the small test tensors take the packed-runs path too
    reads = []
    orig = strided.pread_into

    def spy(fd, view, offset, path):
        reads.append(len(view))
        assert len(view) <= buffer
        orig(fd, view, offset, path)

    monkeypatch.setattr(strided, "pread_into", spy)
    hub = HubPlan(
        (
            TensorView("w_t", "w", (0, 0, 0), (3, 40, 24), (3, 24, 40), (3, 40, 24), (0, 2, 1)),
            TensorView("m_t", "m", (0, 0), (36, 20), (20, 36), (36, 20), (1, 0)),
        )
    )
    (tmp_path / "out").mkdir()
    res = consolidate_into(src, tmp_path / "out", views=hub, dtype=dtype)
    got: dict[str, torch.Tensor] = {}
    for name, _ in res.files:
        got.update(load_file(tmp_path / "out" / name))
    want = {"w_t": full["w"].transpose(1, 2).contiguous(), "m_t": full["m"].T.contiguous()}
    for name, w in want.items():
        w = w if dtype is None else w.to(torch.bfloat16)
        assert got[name].dtype == w.dtype and torch.equal(got[name], w), name
    assert reads
