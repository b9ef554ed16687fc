"""A commit marker lists every tensor, so its bytes and the memory of reading it grow with the tensor count:
both stay a few dozen bytes per tensor beyond the names, and a marker an older stagerd wrote (an object per
tensor and per view, indented) still reads the same. Targets live in bench/bench_marker.py and BENCHMARKS.md.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import tracemalloc
from pathlib import Path
from typing import Any

import pytest

from stagerd.contract import commit_marker, layout
from stagerd.contract.commit_marker import CommitMarker, StagedFile, TensorInfo
from stagerd.contract.hub_plan import Holds, HubPlan, LoraMerge, SharedStorage, TensorView, ZeroFill
from stagerd.contract.lora_merge import ExpertLayout, MergeKind
from stagerd.errors import MarkerError

N_OUTPUTS = 10_000
EXPERTS = 8
_LAYER = (
    ("self_attn.q_proj.weight", (4096, 4096)),
    ("self_attn.k_proj.weight", (1024, 4096)),
    ("self_attn.v_proj.weight", (1024, 4096)),
    ("self_attn.o_proj.weight", (4096, 4096)),
    ("input_layernorm.weight", (4096,)),
    ("post_attention_layernorm.weight", (4096,)),
)


def synthetic_marker(n: int, ranks: int = 64, reference: bool = False) -> CommitMarker:
    """The marker the training side writes for a MoE model saved under a wrapper's `model.` prefix, with
    about `n` output tensors: every staged key renamed (a whole-tensor view), each layer's fused experts
    split into a gate and an up view per expert (one shared storage), the embedding tied to the LM head,
    and the save order naming every output. `reference`: with the weight_map of a reference index over
    4 files (sorted by name, as `save_pretrained` writes it), as the Stager records one it is given."""
    tensors: dict[str, TensorInfo] = {}
    views: list[TensorView] = []
    order: list[str] = []
    shared: list[SharedStorage] = []
    layer = 0
    while len(order) < n:
        staged, out = f"model.model.layers.{layer}.", f"model.layers.{layer}."
        for key, shape in _LAYER:
            tensors[staged + key] = TensorInfo("BF16", shape)
            views.append(TensorView(out + key, staged + key, (0,) * len(shape), shape, shape))
            order.append(out + key)
        fused = staged + "mlp.experts.gate_up_proj"
        tensors[fused] = TensorInfo("BF16", (EXPERTS, 2 * 1408, 4096))
        names = []
        for e in range(EXPERTS):
            for j, w in enumerate(("gate_proj", "up_proj")):
                names.append(f"{out}mlp.experts.{e}.{w}.weight")
                views.append(TensorView(names[-1], fused, (e, j * 1408, 0), (1, 1408, 4096), (1408, 4096)))
        order += names
        shared.append(SharedStorage(tuple(names), EXPERTS * 2 * 1408 * 4096))
        layer += 1
    emb, whole = "model.model.embed_tokens.weight", ((0, 0), (32000, 4096), (32000, 4096))
    tensors[emb] = TensorInfo("BF16", (32000, 4096))
    tensors["model.model.norm.weight"] = TensorInfo("F32", (4096,))
    views += [TensorView("model.embed_tokens.weight", emb, *whole), TensorView("lm_head.weight", emb, *whole)]
    order += ["model.embed_tokens.weight", "lm_head.weight"]
    plan = HubPlan(
        tuple(views),
        ("model.model.norm.weight",),
        origin="transformers",
        order=tuple(order),
        shared=tuple(shared),
        parameters=1 << 40,
    )
    files = tuple(StagedFile(f"model/__{r}_0.distcp", 1 << 30) for r in range(ranks))
    ref = None
    if reference:
        ref = {
            k: f"model-{1 + 4 * i // len(order):05d}-of-00004.safetensors"
            for i, k in enumerate(sorted(order))
        }
    return CommitMarker(
        step=7,
        world_size=ranks,
        files=files,
        created=1.5,
        tensors=tensors,
        hub_plan=plan,
        reference_index=ref,
    )


def old_form(marker: CommitMarker) -> bytes:
    """The marker as stagerd wrote it before the compact form: indented, an object per tensor, `stagerd.hub/1`
    plans with an object per view and the save order spelled out."""
    d: dict[str, Any] = {
        "format": marker.format,
        "step": marker.step,
        "world_size": marker.world_size,
        "files": [{"path": f.path, "size": f.size} for f in marker.files],
        "created": marker.created,
        "reference_index": marker.reference_index,
        "dtype": marker.dtype,
        "metadata": marker.metadata,
        "tensors": None
        if marker.tensors is None
        else {k: {"dtype": v.dtype, "shape": list(v.shape)} for k, v in marker.tensors.items()},
        "staging_node": marker.staging_node,
        "staging_nodes": marker.staging_nodes,
        "hub_plan": None if marker.hub_plan is None else marker.hub_plan.to_json(),
        "adapter_plan": None if marker.adapter_plan is None else marker.adapter_plan.to_json(),
    }
    return (json.dumps(d, indent=2) + "\n").encode()


@pytest.fixture(scope="module")
def big(tmp_path_factory) -> tuple[CommitMarker, Path, Path]:
    """The marker of N_OUTPUTS outputs, written by this stagerd and in the old form."""
    marker = synthetic_marker(N_OUTPUTS, reference=True)
    new, old = (tmp_path_factory.mktemp(w) / "step-00000007" for w in ("new", "old"))
    new.mkdir()
    old.mkdir()
    commit_marker.write_marker(new, marker)
    (old / layout.MARKER_NAME).write_bytes(old_form(marker))
    return marker, new, old


def _outputs(marker: CommitMarker) -> int:
    assert marker.hub_plan is not None
    return len(marker.hub_plan.order)


def test_the_marker_costs_a_few_dozen_bytes_per_output_beyond_its_names(big):
    marker, new, old = big
    names = sum(len(v.name) for v in marker.hub_plan.views) + sum(len(n) for n in marker.tensors)
    size = (new / layout.MARKER_NAME).stat().st_size
    # Measured 76 B per output in all, 16 beyond the names; the old form was 575 B (515 beyond the names).
    assert (size - names) / _outputs(marker) < 30, (size, names)
    assert (old / layout.MARKER_NAME).stat().st_size > 5 * size


def test_reading_the_marker_costs_a_few_hundred_bytes_per_output(big):
    marker, new, _ = big
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        read = commit_marker.read_marker(new)
        gc.collect()
        kept, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert read == marker
    n = _outputs(marker)
    # Measured 289 B kept and 500 B at the peak per output (its names' strings ~120 B of each). The old
    # reader kept 1,093 B and peaked at 6,703 B: its 64 MiB read buffer came on top, at any marker size.
    assert (kept - before) / n < 400, (kept - before) / n
    assert (peak - before) / n < 700, (peak - before) / n


def test_a_marker_in_the_old_form_reads_the_same(big):
    marker, new, old = big
    assert commit_marker.read_marker(old) == commit_marker.read_marker(new) == marker
    # the identity is still the sha256 of the bytes on disk: the same save written two ways is two files
    for d in (new, old):
        assert commit_marker.marker_identity(d) == commit_marker.identity_of(
            (d / layout.MARKER_NAME).read_bytes()
        )
    assert commit_marker.marker_identity(new) != commit_marker.marker_identity(old)


def test_every_plan_field_round_trips(tmp_path):
    """Boxes with a permutation and with a place in a concatenation, a zero fill and a merge as sources, an
    order and a shared storage that name neither a tensor nor a view, a drop, an adapter plan, no tensors."""
    views = (
        TensorView("q", "qkv", (0, 0), (4, 8), (4, 8), (2, 2, 8), (1, 0, 2)),
        TensorView("cat", "a", (0,), (3,), (3,), at=(0,), whole=(5,)),
        TensorView("cat", "a#zeros0", (0,), (2,), (2,), at=(3,), whole=(5,)),
        TensorView("m", "merged", (0, 0), (2, 2), (2, 2)),
        TensorView("qkv", "qkv", (0, 0), (12, 8), (12, 8)),
    )
    plan = HubPlan(
        views,
        ("b",),
        merges=(
            LoraMerge("merged", "base", "la", "lb", 0.5, fan_in_fan_out=True),
            LoraMerge(
                "experts",
                "fused",
                "ea",
                "eb",
                2.0,
                kind=MergeKind.EXPERTS,
                experts=8,
                layout=ExpertLayout.EIO,
            ),
        ),
        zeros=(ZeroFill("a#zeros0", "F32", (2,)),),
        order=("cat", "q", "elsewhere", "qkv", "m"),
        shared=(
            SharedStorage(("q", "qkv", "nowhere"), 96),
            SharedStorage(("cat",), 40, Holds.KEPT),
            SharedStorage(("m", "cat"), 9, Holds.CAST),
        ),
        parameters=3,
    )
    infos = {"qkv": TensorInfo("F32", (12, 8)), "a": TensorInfo("F32", (3,)), "b": TensorInfo("I8", ())}
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "__0_0.distcp").write_bytes(b"abc")
    files = (StagedFile("model/__0_0.distcp", 3),)
    ref = {"q": "a.safetensors", "qkv": "b.safetensors", "elsewhere": "a.safetensors", "b": "a.safetensors"}
    for tensors in (infos, None):
        marker = CommitMarker(
            1, 1, files, tensors=tensors, hub_plan=plan, adapter_plan=plan, reference_index=ref
        )
        commit_marker.write_marker(tmp_path, marker)
        assert commit_marker.read_marker(tmp_path) == marker
        commit_marker.check_staged_files(tmp_path, commit_marker.read_marker(tmp_path))
        assert CommitMarker.from_json(json.loads(old_form(marker))) == marker


def _mangled(**change: Any) -> dict[str, Any]:
    marker = CommitMarker(
        step=1,
        world_size=1,
        files=(),
        tensors={"a": TensorInfo("F32", (2,)), "b": TensorInfo("F32", (2,))},
        hub_plan=HubPlan((TensorView("c", "a", (0,), (2,), (2,)),), order=("c", "b"), shared=()),
        reference_index={"c": "x.safetensors", "b": "x.safetensors"},
    )
    d = json.loads(json.dumps(marker.to_json()))
    for where, value in change.items():
        section, key = where.split("__")
        target = {"tensors": d["tensors"], "ref": d["reference_index"]}.get(section, d["hub_plan"])
        if section == "views":
            target = target["views"]
        target[key] = value
    return d


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"tensors__info": [0, 5]}, "info 5 is not in the table"),
        ({"tensors__info": [0]}, "do not match up"),
        ({"tensors__names": ["a", "a"]}, "listed twice"),
        ({"tensors__infos": [["F32", [2.5]]]}, "non-negative integers"),
        ({"tensors__infos": [["F32"]]}, "non-negative integers"),
        ({"views__sources": [9]}, "not a saved tensor's name"),
        ({"views__box": [3]}, "not in the plan's boxes"),
        ({"views__box": []}, "not lists of one length"),
        ({"views__boxes": [[[0], [2]]]}, "malformed to-Hub plan"),
        ({"plan__order": [[1, 9]]}, "not a name, nor a run of names"),
        ({"plan__order": [[-1, 1]]}, "not a name, nor a run of names"),
        ({"plan__drop": "a"}, "malformed to-Hub plan"),
        ({"plan__shared": [[2, [[0, 1]], "sometimes"]]}, "malformed to-Hub plan"),
        ({"plan__shared": [[2, [[0, 1]], 1]]}, "malformed to-Hub plan"),
        ({"plan__shared": [[2, [[0, 1]], "kept", "cast"]]}, "malformed to-Hub plan"),
        ({"ref__files": ["a.safetensors", "b.safetensors"]}, "files and names do not match up"),
        ({"ref__names": [[[0, 7]]]}, "not a name, nor a run of names"),
        ({"ref__names": [[[0, 3], [0, 3]]]}, "more names than the 3"),
        ({"ref__files": ["x", "y"], "ref__names": [[[0, 3]], [[0, 3]]]}, "more names than the 3"),
        ({"plan__order": [[0, 3], [0, 1]]}, "more names than the 3"),
        ({"plan__shared": [[2, [[0, 2]]], [2, [[1, 2]]]]}, "more names than the 3"),
    ],
)
def test_a_bad_compact_marker_is_a_marker_error(change, match):
    with pytest.raises(MarkerError, match=match):
        CommitMarker.from_json(_mangled(**change))


def test_name_runs_that_would_expand_past_the_table_are_refused(tmp_path):
    """A run `[0, T]` is a few bytes yet names T tensors: repeated, a marker of a hundred kilobytes read as
    tens of millions of names (hundreds of MiB). A list names each of the marker's names once at most."""
    names = [f"t{i}" for i in range(2000)]
    marker = CommitMarker(1, 1, (), tensors={n: TensorInfo("F32", (2,)) for n in names})
    d = marker.to_json()
    d["reference_index"] = {"files": ["a.safetensors"], "names": [[[0, 2000]] * 10_000]}
    step = tmp_path / "step-00000001"
    step.mkdir()
    (step / layout.MARKER_NAME).write_text(json.dumps(d))
    with pytest.raises(MarkerError, match="more names than the 2000") as e:
        commit_marker.read_marker(step)
    assert e.value.path is not None


def test_a_shared_storage_without_holds_always_holds():
    """A marker from before `holds` (compact `[numel, names]`, or `stagerd.hub/1`'s object without it): each
    shared storage holds always, as it did; one that always holds is still written that way."""
    plan = HubPlan((), order=("a", "b"), shared=(SharedStorage(("a", "b"), 4),))
    marker = CommitMarker(1, 1, (), tensors={"a": TensorInfo("F32", (2,)), "b": TensorInfo("F32", (2,))})
    marker = dataclasses.replace(marker, hub_plan=plan)
    d = json.loads(json.dumps(marker.to_json()))
    assert d["hub_plan"]["shared"] == [[4, [[0, 2]]]]
    assert CommitMarker.from_json(d).hub_plan == plan
    old = json.loads(old_form(marker))
    assert old["hub_plan"]["shared"] == [{"names": ["a", "b"], "numel": 4}]
    assert CommitMarker.from_json(old).hub_plan.shared[0].holds is Holds.ALWAYS
