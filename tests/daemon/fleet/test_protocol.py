"""Issue 14: node-local ROOTs build one HF export together through the exchange, equal byte for byte to the
single-daemon export of the same step from a shared ROOT. Nodes are threads here (each its own ROOT, its
own sink and exchange clients); the 4-rank gloo save is the session's `dcp_mixed`."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from stagerd.contract import commit_marker, layout
from stagerd.contract.dtypes import safetensors_name
from stagerd.daemon.fleet.node import FleetResult
from stagerd.engine.export import export_step
from stagerd.errors import FleetNodeConflictError, FleetWaitError, StagerdError, StepConflictError
from stagerd.sinks.fsspec import FsspecSink
from tests.dcp_fixtures import commit_step
from tests.fleet_helpers import fleet_node, run_fleet
from tests.s3server import s3, s3_server  # noqa: F401  (fixtures)

STEP = 7
SHARD = 1500  # small output files, so that every node owns some


def _stage(
    tmp: Path, model: Path, nodes: int, dtype: str | None = None, extras: dict[str, str] | None = None
) -> tuple[Path, list[Path]]:
    """The same save staged twice: one shared ROOT, and `nodes` node-local ROOTs (shards dealt round-robin,
    extras on node 0, as the Stager's node-local mode writes them)."""
    shards = sorted(model.glob("*.safetensors"))
    shared = tmp / "shared" / layout.step_dir_name(STEP)
    (shared / "model").mkdir(parents=True)
    for rel, text in {"config.json": '{"model_type": "tiny"}', **(extras or {})}.items():
        (shared / "extras" / rel).parent.mkdir(parents=True, exist_ok=True)
        (shared / "extras" / rel).write_text(text)
    for s in shards:
        shutil.copy(s, shared / "model" / s.name)
    whole = commit_step(shared, len(shards), dtype=dtype)
    node_dirs = []
    for k in range(nodes):
        d = tmp / f"node{k}" / layout.step_dir_name(STEP)
        (d / "model").mkdir(parents=True)
        for s in shards[k::nodes]:
            shutil.copy(s, d / "model" / s.name)
        if k == 0:
            shutil.copytree(shared / "extras", d / "extras")
        commit_step(
            d,
            len(shards),
            dtype=dtype,
            tensors=whole.tensors,
            created=whole.created,  # one save: every node's marker has rank 0's time
            staging_node=k,
            staging_nodes=nodes,
        )
        node_dirs.append(d)
    return shared, node_dirs


def _node(step_dir: Path, url: str, exchange: str | None = None, root_id: str | None = None, **opts):
    return fleet_node(step_dir, url, exchange, root_id, **{"max_shard_size": SHARD, **opts})


def _run_all(node_dirs: list[Path], url: str, **kw) -> list[FleetResult | BaseException]:
    return run_fleet(node_dirs, url, **{"max_shard_size": SHARD, **kw})


def _tree(keys: dict[str, int], env, prefix: str) -> dict[str, bytes]:
    pre = f"{prefix}/{layout.step_dir_name(STEP)}/"
    return {
        k[len(pre) :]: env.get(k) for k in keys if k.startswith(pre) and not k.endswith(layout.MANIFEST_NAME)
    }


def _keys(env) -> dict[str, int]:
    out = {}
    for page in env.client.get_paginator("list_objects_v2").paginate(Bucket=env.bucket):
        out.update({o["Key"]: o["Size"] for o in page.get("Contents", [])})
    return out


@pytest.mark.parametrize(("nodes", "dtype"), [(2, None), (3, "bf16")])
def test_nodes_build_the_single_node_export_byte_for_byte_each_doing_a_share(
    tmp_path,
    dcp_mixed,
    s3,  # noqa: F811
    nodes,
    dtype,
):
    shared, node_dirs = _stage(tmp_path, dcp_mixed[0], nodes, dtype)
    export_step(shared, max_shard_size=SHARD)
    FsspecSink.from_url(s3.url("single")).publish(shared / layout.EXPORT_DIR, STEP)
    results = _run_all(node_dirs, s3.url("fleet"))
    assert all(isinstance(r, FleetResult) for r in results), results
    keys = _keys(s3)
    single, fleet = _tree(keys, s3, "single"), _tree(keys, s3, "fleet")
    assert len(single) > nodes + 2 and single == fleet  # every file, byte for byte, and no other
    assert s3.get(f"fleet/{layout.step_dir_name(STEP)}/{layout.MANIFEST_NAME}")
    assert s3.get("fleet/latest") == layout.step_dir_name(STEP).encode()
    built = [r.built for r in results]  # type: ignore[union-attr]
    assert all(built) and sorted(n for b in built for n in b) == sorted(
        n for n in single if n.endswith(".safetensors")
    )
    assert [r.committed for r in results] == [True] + [False] * (nodes - 1)  # type: ignore[union-attr]
    # every node reports the whole export, as the sink holds it, not its share (status, the log)
    sizes = sorted((name, len(data)) for name, data in single.items())
    assert all(r.files == sizes for r in results), (sizes, results)  # type: ignore[union-attr]
    shards = sum(len(data) for name, data in single.items() if name.endswith(".safetensors"))
    assert sum(r.own_bytes for r in results) == shards and all(r.own_bytes for r in results)  # type: ignore[union-attr]
    assert all(r.bytes_fetched < sum(f.stat().st_size for f in shared.glob("model/*")) for r in results)  # type: ignore[union-attr]
    again = _run_all(node_dirs, s3.url("fleet"))  # published: a second run does nothing
    assert all(isinstance(r, FleetResult) and not r.built and r.files == sizes for r in again), again


def test_a_node_that_never_starts_leaves_the_step_waiting_and_unpublished(tmp_path, dcp_mixed2, s3):  # noqa: F811
    _, node_dirs = _stage(tmp_path, dcp_mixed2[0], 2)
    node, seen = _node(node_dirs[0], s3.url("fleet"), wait_seconds=0.5)
    with pytest.raises(FleetWaitError, match="waiting for node 1 \\(seen: node-00000-of-00002\\)"):
        node.run()
    assert seen and seen[-1].startswith("waiting for node 1")
    assert not [k for k in _keys(s3) if k.startswith(f"fleet/{layout.step_dir_name(STEP)}/")]
    assert FleetWaitError.retryable  # the daemon backs off and tries again: never quarantined
    results = _run_all(node_dirs, s3.url("fleet"))  # the late node comes: the step completes
    assert all(isinstance(r, FleetResult) for r in results), results


def test_two_roots_claiming_one_node_id_is_a_named_error(tmp_path, dcp_mixed2, s3):  # noqa: F811
    _, node_dirs = _stage(tmp_path, dcp_mixed2[0], 2)
    first, _ = _node(node_dirs[0], s3.url("fleet"), root_id="root-a", wait_seconds=0.1)
    with pytest.raises(FleetWaitError):
        first.run()
    second, _ = _node(node_dirs[0], s3.url("fleet"), root_id="root-b", wait_seconds=0.1)
    with pytest.raises(FleetNodeConflictError, match="node 0 of 2 is already claimed by another ROOT") as e:
        second.run()
    # the copy of a ROOT, or a ROOT whose identity was made again (test_root_id.py), is told how to go on
    assert "taken for a copy" in e.value.hint and "fleet/step-00000007/node-00000.json" in e.value.hint
    assert issubclass(FleetNodeConflictError, StagerdError) and not FleetNodeConflictError.retryable


@pytest.mark.parametrize("pruned", [False, True], ids=["published", "pruned"])
def test_a_step_saved_again_is_never_taken_for_the_first_save(tmp_path, dcp_mixed2, pruned):
    """A run restarted from an earlier checkpoint saves step 7 again, into the same ROOTs, with other data
    (same file names, other bytes). While the sinks hold the first save's step 7, the new save must not be
    called published; once retention took that step and its raw parts, the first save's records on the
    exchange must not pass for the new save's (they did: its nodes built nothing and the leader's
    verification failed on every retry). Both are a named conflict, and nothing is written."""
    _, first_dirs = _stage(tmp_path, dcp_mixed2[0], 2, dtype="fp16")
    sink = tmp_path / "sink"
    assert all(isinstance(r, FleetResult) for r in _run_all(first_dirs, sink.as_uri()))
    name = layout.step_dir_name(STEP)
    if pruned:
        shutil.rmtree(sink / name)
        shutil.rmtree(sink / "raw" / name)
    before = sorted(str(p.relative_to(sink)) for p in sink.rglob("*"))
    for d in [tmp_path / "shared", *(d.parent for d in first_dirs)]:
        shutil.rmtree(d)
    _, again_dirs = _stage(tmp_path, dcp_mixed2[0], 2, dtype="bf16")
    results = _run_all(again_dirs, sink.as_uri())
    assert all(isinstance(r, StepConflictError) for r in results), results
    assert "belongs to another save of this step" in str(results[0])
    assert sorted(str(p.relative_to(sink)) for p in sink.rglob("*")) == before


def test_a_hub_sink_style_file_exchange(tmp_path, dcp_mixed2):
    """A file:// exchange shared by the nodes, separate from the sink."""
    shared, node_dirs = _stage(tmp_path, dcp_mixed2[0], 2)
    export_step(shared, max_shard_size=SHARD)
    sink, ex = tmp_path / "sink", tmp_path / "exchange"
    results = _run_all(node_dirs, sink.as_uri(), exchange=ex.as_uri())
    assert all(isinstance(r, FleetResult) for r in results), results
    got = _published(sink)
    want = {p.name: p.read_bytes() for p in (shared / layout.EXPORT_DIR).iterdir()}
    assert got == want
    assert (ex / "raw" / layout.step_dir_name(STEP) / "node-00001-of-00002" / layout.MANIFEST_NAME).exists()


def _published(sink: Path) -> dict[str, bytes]:
    """Name -> bytes of the files STEP has on a file:// sink, its manifest left out (the single daemon's
    export has none)."""
    out = sink / layout.step_dir_name(STEP)
    return {p.name: p.read_bytes() for p in out.iterdir() if p.name != layout.MANIFEST_NAME}


def _with_hub_plan(dirs: list[Path], plan, key: str = "hub_plan") -> None:
    for d in dirs:
        marker = json.loads((d / layout.MARKER_NAME).read_text())
        marker[key] = plan.to_json()
        (d / layout.MARKER_NAME).write_text(json.dumps(marker))


def test_a_to_hub_plan_is_carried_out_as_by_one_daemon(tmp_path, dcp_mixed2):
    """A to-Hub plan's views and drops are byte moves: a split across both nodes' shards, a rename and a
    drop give the single-daemon export byte for byte."""
    from stagerd.contract.hub_plan import HubPlan, TensorView

    emb, o = "model.embed_tokens.weight", "model.layers.0.self_attn.o_proj.weight"
    views = (
        TensorView("model.embed_tokens.top", emb, (0, 0), (20, 16), (20, 16)),
        TensorView("model.embed_tokens.rest", emb, (20, 0), (17, 16), (17, 16)),
        TensorView("model.layers.0.self_attn.out.weight", o, (0, 0), (16, 13), (16, 13)),
    )
    shared, node_dirs = _stage(tmp_path / "views", dcp_mixed2[0], 2)
    _with_hub_plan([shared, *node_dirs], HubPlan(views, drop=("lm_head.weight",), origin="transformers"))
    want = export_step(shared, max_shard_size=SHARD).export_dir
    sink = tmp_path / "sink"
    results = _run_all(node_dirs, sink.as_uri(), exchange=(tmp_path / "exchange").as_uri())
    assert all(isinstance(r, FleetResult) for r in results), results
    got = _published(sink)
    assert got == {p.name: p.read_bytes() for p in want.iterdir()}
    index = got[layout.INDEX_NAME].decode()
    assert "model.embed_tokens.rest" in index and emb not in index and "lm_head.weight" not in index
    assert all(r.built for r in results)  # type: ignore[union-attr]

    # --mapping, for a step saved without a plan of its own: the same plan export_step makes of it
    shared, node_dirs = _stage(tmp_path / "mapping", dcp_mixed2[0], 2)
    shapes = {
        k: {"dtype": safetensors_name(v.dtype), "shape": list(v.shape)} for k, v in dcp_mixed2[1].items()
    }
    for d in [shared, *node_dirs]:  # the global shapes, as the Stager records them
        marker = json.loads((d / layout.MARKER_NAME).read_text())
        (d / layout.MARKER_NAME).write_text(json.dumps({**marker, "tensors": shapes}))
    split = [{"name": "emb.a", "size": 20}, {"name": "emb.b", "size": 17}]
    mapping = tmp_path / "mapping.json"
    mapping.write_text(json.dumps({"rules": [{"match": re.escape(emb), "split_dim": 0, "split": split}]}))
    want = export_step(shared, max_shard_size=SHARD, mapping=mapping).export_dir
    sink = tmp_path / "sink-mapping"
    results = _run_all(node_dirs, sink.as_uri(), mapping=mapping)
    assert all(isinstance(r, FleetResult) for r in results), results
    got = _published(sink)
    assert got == {p.name: p.read_bytes() for p in want.iterdir()} and b"emb.b" in got[layout.INDEX_NAME]


def test_lora_merges_and_a_peft_adapter_are_carried_out_as_by_one_daemon(tmp_path, dcp_mixed2):
    """A PEFT model's step: LoRA merges whose base, A and B are each split over both nodes' shards (one
    merged tensor split again by a view), and the adapter artefact with its config. Every published file,
    `adapter/` included, and the manifest's entries equal the single-daemon export's, cast to bf16."""
    from stagerd.contract.hub_plan import HubPlan, LoraMerge, TensorView
    from stagerd.contract.safetensors_format import read_header

    emb, q, o, head = (
        "model.embed_tokens.weight",  # 37 x 16, F32, rows by rank
        "model.layers.0.self_attn.q_proj.weight",  # 16 x 16, BF16, rows by rank
        "model.layers.0.self_attn.o_proj.weight",  # 16 x 13, F32, columns by rank
        "lm_head.weight",  # 37 x 16, F32, rows by rank
    )
    merges = (LoraMerge("merged.emb", emb, q, head, 0.25), LoraMerge("merged.o", o, o, q, 0.5))
    views = (
        TensorView("merged.emb.top", "merged.emb", (0, 0), (20, 16), (20, 16)),
        TensorView("merged.emb.rest", "merged.emb", (20, 0), (17, 16), (17, 16)),
    )
    adapter = HubPlan(
        (
            TensorView("base_model.model.q.lora_A.weight", q, (0, 0), (16, 16), (16, 16)),
            TensorView("base_model.model.q.lora_B.weight", o, (0, 0), (16, 13), (16, 13)),
        ),
        drop=tuple(n for n in dcp_mixed2[1] if n not in (q, o)),
        origin="peft",
    )
    config = {"adapter/adapter_config.json": '{"peft_type": "LORA", "r": 16}'}
    shared, node_dirs = _stage(tmp_path, dcp_mixed2[0], 2, "bf16", extras=config)
    for d in [shared, *node_dirs]:
        _with_hub_plan([d], HubPlan(views, origin="peft", merges=merges))
        _with_hub_plan([d], adapter, key="adapter_plan")
    held = [{n for s in (d / "model").iterdir() for n in read_header(s).tensors} for d in node_dirs]
    assert all({emb, q, o, head} <= h for h in held)  # every merge reads blocks of both nodes
    want = export_step(shared, max_shard_size=SHARD).export_dir
    single = tmp_path / "single"
    FsspecSink.from_url(single.as_uri()).publish(want, STEP)
    sink = tmp_path / "sink"
    results = _run_all(node_dirs, sink.as_uri(), exchange=(tmp_path / "exchange").as_uri())
    assert all(isinstance(r, FleetResult) for r in results), results

    def tree(root: Path) -> dict[str, bytes]:
        return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}

    out = sink / layout.step_dir_name(STEP)
    got = {k: v for k, v in tree(out).items() if k != layout.MANIFEST_NAME}
    assert got == tree(want) and "adapter/adapter_model.safetensors" in got
    assert b"merged.emb.rest" in got[layout.INDEX_NAME] and emb.encode() not in got[layout.INDEX_NAME]
    manifests = [json.loads((d / layout.MANIFEST_NAME).read_text()) for d in (out, single / out.name)]
    assert manifests[0]["files"] == manifests[1]["files"]
    built = [r.built for r in results]  # type: ignore[union-attr]
    assert all(built) and sorted(n for b in built for n in b) == sorted(
        n for n in got if n.endswith(".safetensors")
    )
    for k, r in enumerate(results):  # merge inputs come from the other node, its shards at most
        other = sum(f.stat().st_size for f in (node_dirs[1 - k] / "model").iterdir())
        assert 0 < r.bytes_fetched <= other  # type: ignore[union-attr]


def test_the_mirror_fetches_a_byte_once_however_often_it_is_read(tmp_path):
    """A merge input read again by a second merge, or by a file's moves, costs no second ranged read."""
    from stagerd.daemon.fleet.plan import Mirror

    data = bytes(range(64))
    calls: list[tuple[int, int]] = []

    def read(key: str, start: int, end: int) -> bytes:
        calls.append((start, end))
        return data[start:end]

    mirror = Mirror(tmp_path, tmp_path, [], 0, read)
    shard = tmp_path / "shard"
    shard.write_bytes(bytes(64))
    mirror.remote[str(shard)] = "raw/step/node-1/model/shard"
    mirror.fill([(str(shard), 8, 8), (str(shard), 12, 8)])
    mirror.fill([(str(shard), 0, 40), (str(shard), 50, 4)])
    assert calls == [(8, 20), (0, 8), (20, 40), (50, 54)]
    assert mirror.fetched == 44 and shard.read_bytes()[:54] == data[:40] + bytes(10) + data[50:54]


def test_the_mirror_never_links_a_shard_through_a_link(tmp_path):
    """The node's own shard replaced by a link (here to a private file outside ROOT) after the raw part
    was sent, while the node waited for the others: `os.link` followed it, hard-linking the target into
    the mirror, and the plan read it as the shard. Now the shard is opened without following a link from
    the step held open: a SymlinkError naming it, nothing in the mirror."""
    from stagerd.daemon.fleet.plan import Mirror, NodePart
    from stagerd.errors import SymlinkError

    step, secret = tmp_path / "root" / "step-7", tmp_path / "id_ed25519"
    (step / "model").mkdir(parents=True)
    secret.write_bytes(b"\x08" + bytes(7) + b"{}      " + b"private key")
    shard = step / "model" / "model-rank0.safetensors"
    shard.symlink_to(secret)
    marker = commit_marker.CommitMarker(
        STEP, 1, (commit_marker.StagedFile("model/model-rank0.safetensors", 27),)
    )
    mirror = Mirror(tmp_path / "work", step, [NodePart(0, marker, "raw")], 0, lambda *a: b"")
    with pytest.raises(SymlinkError) as e:
        mirror.build()
    assert e.value.path == str(shard) and len(str(e.value).splitlines()) == 1, e.value
    assert not (tmp_path / "work" / "model" / shard.name).exists()


def test_the_leader_never_publishes_an_extra_through_a_link(tmp_path, dcp_mixed2, s3, monkeypatch):  # noqa: F811
    """Node 0's `extras/config.json` replaced by a link (to a private file outside ROOT) after its raw part
    was sent, while it waited for the others: the leader copied it with `shutil.copyfile`, which follows
    the link, and published the private file as the model's config. Now it is opened without following a
    link from the step held open: a SymlinkError naming it, nothing published."""
    import stagerd.daemon.fleet.lead as lead_mod
    from stagerd.errors import SymlinkError

    _, node_dirs = _stage(tmp_path, dcp_mixed2[0], 2, extras={"tokenizer.json": '{"v": 1}'})
    secret = tmp_path / "id_ed25519"
    secret.write_text('{"private": "key"}')
    real = lead_mod.extras_of

    def swapped(parts):
        tok = node_dirs[0] / layout.EXTRAS_DIR / "tokenizer.json"
        tok.unlink()
        tok.symlink_to(secret)
        return real(parts)

    monkeypatch.setattr(lead_mod, "extras_of", swapped)
    results = _run_all(node_dirs, s3.url("fleet"), wait_seconds=1)
    assert isinstance(results[0], SymlinkError), results
    assert str(node_dirs[0] / layout.EXTRAS_DIR / "tokenizer.json") in str(results[0])
    published = [k for k in _keys(s3) if k.startswith(f"fleet/{layout.step_dir_name(STEP)}/")]
    assert not any(b"private" in (s3.get(k) or b"") for k in published)
    assert f"fleet/{layout.step_dir_name(STEP)}/{layout.MANIFEST_NAME}" not in published
