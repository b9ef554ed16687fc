"""Node-local staging roots (two "nodes" on one host): a marker per node, and a refusal on one node."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from stagerd.contract import commit_marker, layout
from tests.export_index import export_index
from tests.gloo import join, launch
from tests.training.gloo_run import WORLD, attempt, dtensors, full_state, params, train_step


def _node_local_run(rank: int, world: int, init_file: str, base: str) -> None:
    import torch.distributed as dist

    from stagerd import Stager

    os.environ["STAGERD_NODE_ID"] = f"node{rank}"
    join(rank, world, init_file)
    try:
        sd = dtensors(world, rank)
        root = Path(base) / f"node{rank}"
        group = dist.new_group([0, 1])  # an explicit group: the Stager builds its gloo group from it
        with Stager(root, checkpointer="process", process_group=group) as stager:
            assert not stager.topology.shared and stager.topology.num_nodes == 2
            # The first save fails before the write on node 1 (its leader cannot clear a stale step dir).
            if rank == 1:
                (root / "step-00000002").mkdir()
                (root / "step-00000002" / "model").write_text("not a directory")
            failed = attempt(stager, sd, 2)
            (Path(base) / f"failed{rank}.json").write_text(json.dumps(failed))
            full = full_state(sd)
            if rank == 0:
                save_file(full, str(Path(base) / "expected.safetensors"))
            stager.save(sd, 3, extras={"config.json": {"a": 1}}, optimizer_state={"m": sd["lm_head.weight"]})
            stager.wait_staged()
            train_step(sd, 3)
            stager.wait()
    finally:
        dist.destroy_process_group()


def test_node_local_roots_write_a_marker_per_node(tmp_path):
    launch(_node_local_run, str(tmp_path))
    for r in range(WORLD):
        failed = json.loads((tmp_path / f"failed{r}.json").read_text())
        assert failed["save"] is None and failed["wait"] == failed["handle"]
        assert "step 2 was not committed" in failed["handle"], failed["handle"]
        assert "NotADirectoryError" in failed["handle"] and "(reported by rank 1)" in failed["handle"]
        assert not layout.is_committed(tmp_path / f"node{r}" / "step-00000002")
    markers = [commit_marker.read_marker(tmp_path / f"node{r}" / "step-00000003") for r in range(WORLD)]
    for r, m in enumerate(markers):
        step_dir = tmp_path / f"node{r}" / "step-00000003"
        commit_marker.check_staged_files(step_dir, m)
        assert (m.staging_node, m.staging_nodes, m.world_size) == (r, 2, WORLD)
        assert set(m.tensors) == set(params(WORLD))
    assert {f.path for f in markers[0].files} == {
        "model/shard-00001-model-00001-of-00001.safetensors",
        "optim/shard-00001-00001.safetensors",
        "optim/shard-00001.objects.pt",
        "extras/config.json",
    }
    assert {f.path for f in markers[1].files} == {
        "model/shard-00002-model-00001-of-00001.safetensors",
        "optim/shard-00002-00001.safetensors",
        "optim/shard-00002.objects.pt",
    }
    # The two nodes' model shards together are exactly the weights at save time.
    merged = tmp_path / "merged"
    (merged / "model").mkdir(parents=True)
    for r, m in enumerate(markers):
        for f in m.files:
            if f.path.startswith("model/"):
                os.link(tmp_path / f"node{r}" / "step-00000003" / f.path, merged / f.path)
    commit_marker.write_marker(
        merged,
        commit_marker.CommitMarker(
            step=3,
            world_size=WORLD,
            files=tuple(f for m in markers for f in m.files if f.path.startswith("model/")),
            tensors=markers[0].tensors,
        ),
    )
    from stagerd.engine.export import export_step

    result = export_step(merged)
    with safe_open(tmp_path / "expected.safetensors", "pt") as f:
        want = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    index = export_index(result.export_dir)
    for name, ref in want.items():
        with safe_open(result.export_dir / index["weight_map"][name], "pt") as f:
            assert torch.equal(f.get_tensor(name).view(torch.uint8), ref.view(torch.uint8)), name
    # Issue 14: the two nodes' daemons build the same export together, through a file:// exchange.
    from stagerd.contract.sharding import DEFAULT_MAX_SHARD_SIZE
    from tests.daemon.fleet.test_protocol import _run_all

    sink = tmp_path / "sink"
    dirs = [tmp_path / f"node{r}" / "step-00000003" for r in range(WORLD)]
    done = _run_all(dirs, sink.as_uri(), max_shard_size=DEFAULT_MAX_SHARD_SIZE)
    assert all(not isinstance(r, BaseException) for r in done), done
    for name, _ in result.files:  # every file, config.json too: it names the dtype the files hold
        assert (sink / "step-00000003" / name).read_bytes() == (result.export_dir / name).read_bytes(), name
    assert json.loads((sink / "step-00000003" / "config.json").read_text()) == {"a": 1, "dtype": "float32"}
