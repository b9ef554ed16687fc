"""`stagerd.Stager` in real gloo multi-process runs: the marker, its files, bit-exact export, failures.

One 2-rank run (module fixture) saves several steps and records what each rank saw; the tests read that
record and the step directories. A second run covers the process checkpointer with node-local roots.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from stagerd import layout
from stagerd.dtypes import safetensors_name
from stagerd.errors import DTypeError, ReferenceIndexError, SaveInputError, StepExistsError

WORLD = 2
SLOW_NUMEL = 8 << 20  # 32 MiB fp32 held by rank 1 alone: its shard is written well after rank 0's


def _params(world: int) -> dict[str, tuple[torch.Tensor, str]]:
    """name -> (initial full tensor, placement): "S0"/"S1" shard a dim, "R" replicate."""
    g = torch.Generator().manual_seed(7)
    return {
        "model.embed_tokens.weight": (torch.randn(37, 16, generator=g), "S0"),
        "model.layers.0.self_attn.q_proj.weight": (torch.randn(16, 16, generator=g).bfloat16(), "S0"),
        "model.layers.0.mlp.up_proj.weight": (torch.randn(12, 10, generator=g).half(), "S1"),
        "model.norm.weight": (torch.randn(16, generator=g), "R"),
        "lm_head.weight": (torch.randn(37, 16, generator=g), "S0"),
    }


def _slow_tensor() -> torch.Tensor:
    return torch.arange(SLOW_NUMEL, dtype=torch.float32)


def _dtensors(world: int, rank: int) -> dict[str, torch.Tensor]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    mesh = init_device_mesh("cpu", (world,))
    sd = {}
    for name, (full, code) in _params(world).items():
        if code == "R":
            local, placements = full.clone(), [Replicate()]
        else:
            d = int(code[1:])
            local, placements = torch.chunk(full, world, dim=d)[rank].clone().contiguous(), [Shard(d)]
        sd[name] = DTensor.from_local(
            local, mesh, placements, run_check=False, shape=full.shape, stride=full.stride()
        )
    return sd


def _train_step(sd: dict[str, torch.Tensor], step: int) -> None:
    """Change every sharded parameter in place, as an optimizer step would."""
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        for t in sd.values():
            if isinstance(t, DTensor):
                t.to_local().mul_(0.5).add_(float(step))


def _local_nbytes(t: torch.Tensor) -> int:
    return (t.to_local() if hasattr(t, "to_local") else t).untyped_storage().nbytes()


def _full(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.full_tensor().contiguous() for k, v in sd.items()}  # collective


def _record(out: Path, rank: int, rec: dict) -> None:
    (out / f"rank{rank}.json").write_text(json.dumps(rec))


def _main_run(rank: int, world: int, init_file: str, root: str, out: str) -> None:
    import torch.distributed as dist

    from stagerd import Stager
    from stagerd.errors import SaveError, SaveInputError

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    out_p, rec = Path(out), {}
    try:
        sd = _dtensors(world, rank)
        if rank == 1:
            sd["slow.rank1"] = _slow_tensor()
        optim = {"state": {k: {"exp_avg": torch.zeros_like(v)} for k, v in sd.items()}, "lr": 0.1}
        extras = {
            "config.json": {"model_type": "tiny", "layers": 1},
            "README.md": b"# tiny\n",
            "tokenizer.json": str(out_p / "tokenizer.json"),
        }
        ref = {k: "model-00001-of-00001.safetensors" for k in _params(world)}
        stager = Stager(root)
        buffers = []
        for step in (1, 2):
            full = _full({k: v for k, v in sd.items() if k != "slow.rank1"})
            if rank == 0:
                save_file(full, str(out_p / f"expected-{step}.safetensors"))
            handle = stager.save(
                sd,
                step,
                extras=extras if rank == 0 else None,
                reference_index=ref if step == 1 else None,
                dtype="bf16",
                optimizer_state=optim,
                metadata={"run": "test"},
            )
            stager.wait_staged()
            buffers.append(stager.staging_buffers())
            _train_step(sd, step)  # mutates the sources while the write is in flight
            rec[f"marker{step}"] = handle.result().to_json()
        rec["buffers"] = [sorted(b.items()) for b in buffers]
        rec["local_bytes"] = sum(_local_nbytes(v) for v in sd.values()) + sum(
            _local_nbytes(t["exp_avg"]) for t in optim["state"].values()
        )
        try:
            stager.save(sd, 1)
            rec["dup"] = None
        except StepExistsError as e:
            rec["dup"] = str(e)
        try:
            stager.save(sd, 5, optimizer_state=optim if rank == 0 else None)
            rec["optim_mismatch"] = None
        except SaveInputError as e:
            rec["optim_mismatch"] = str(e)
        # A write failure on rank 1 (file size limit: EFBIG, as a full disk gives ENOSPC).
        if rank == 1:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))
        handle = stager.save(sd, 7)
        try:
            handle.result()
            rec["fail_handle"] = None
        except SaveError as e:
            rec["fail_handle"] = str(e)
        try:
            stager.wait()
            rec["fail_wait"] = None
        except SaveError as e:
            rec["fail_wait"] = str(e)
        if rank == 1:
            resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        rec["committed_after_failure"] = layout.is_committed(Path(root) / "step-00000007")
        stager.save(sd, 7)  # the same step again, now that the disk "has room"
        rec["retry"] = [m.step for m in stager.wait()]
        stager.close()
        _record(out_p, rank, rec)
    finally:
        dist.destroy_process_group()


class _Watcher(threading.Thread):
    """Polls a step directory: when each file last changed size, and what the marker said when it appeared."""

    def __init__(self, step_dir: Path) -> None:
        super().__init__(daemon=True)
        self.step_dir, self.stop = step_dir, threading.Event()
        self.last_change: dict[str, float] = {}
        self.sizes: dict[str, int] = {}
        self.marker_seen: float | None = None
        self.mismatch_at_marker: list[str] = []

    def run(self) -> None:
        while not self.stop.is_set() and self.marker_seen is None:
            now = time.monotonic()
            for sub in (layout.MODEL_DIR, layout.OPTIM_DIR, layout.EXTRAS_DIR):
                try:
                    entries = list(os.scandir(self.step_dir / sub))
                except FileNotFoundError:
                    continue
                for e in entries:
                    try:
                        size = e.stat().st_size
                    except FileNotFoundError:
                        continue
                    rel = f"{sub}/{e.name}"
                    if self.sizes.get(rel) != size:
                        self.sizes[rel], self.last_change[rel] = size, now
            if layout.is_committed(self.step_dir):
                self.marker_seen = time.monotonic()
                marker = layout.read_marker(self.step_dir)
                for f in marker.files:
                    p = self.step_dir / f.path
                    if not p.is_file() or p.stat().st_size != f.size:
                        self.mismatch_at_marker.append(f.path)
            time.sleep(0.001)


def _spawn(fn, *args) -> None:
    import torch.multiprocessing as mp

    fd, init_file = tempfile.mkstemp(prefix="stagerd-test-gloo-")
    os.close(fd)
    os.unlink(init_file)
    try:
        mp.start_processes(fn, args=(WORLD, init_file, *args), nprocs=WORLD, start_method="spawn")
    finally:
        if os.path.exists(init_file):
            os.unlink(init_file)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("stage-root")
    out = tmp_path_factory.mktemp("stage-out")
    (out / "tokenizer.json").write_text('{"version": "1.0", "model": {}}\n')
    watcher = _Watcher(root / "step-00000001")
    watcher.start()
    try:
        _spawn(_main_run, str(root), str(out))
    finally:
        watcher.stop.set()
        watcher.join()
    recs = [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]
    return root, out, recs, watcher


def _expected(out: Path, step: int) -> dict[str, torch.Tensor]:
    with safe_open(out / f"expected-{step}.safetensors", "pt") as f:
        want = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    want["slow.rank1"] = _slow_tensor()
    return want


def test_marker_appears_only_after_every_rank_finished(run):
    _root, _out, _recs, w = run
    assert w.marker_seen is not None, "the watcher never saw the step-1 marker"
    assert w.mismatch_at_marker == [], f"files incomplete when the marker appeared: {w.mismatch_at_marker}"
    slow = "model/shard-00002-model-00001-of-00001.safetensors"
    assert w.sizes[slow] > SLOW_NUMEL * 4, "rank 1's big shard was not observed"
    late = {p: t for p, t in w.last_change.items() if t > w.marker_seen}
    assert late == {}, f"files changed after the marker appeared: {late}"


def test_marker_lists_every_file_with_its_size(run):
    root, _out, recs, _w = run
    step_dir = root / "step-00000001"
    marker = layout.read_marker(step_dir)
    layout.check_staged_files(step_dir, marker)
    on_disk = {
        str(p.relative_to(step_dir)): p.stat().st_size
        for p in step_dir.rglob("*")
        if p.is_file() and p.name != layout.MARKER_NAME
    }
    assert {f.path: f.size for f in marker.files} == on_disk
    assert set(on_disk) == {
        "model/shard-00001-model-00001-of-00001.safetensors",
        "model/shard-00002-model-00001-of-00001.safetensors",
        "optim/.metadata",
        "optim/__0_0.distcp",
        "optim/__1_0.distcp",
        "extras/config.json",
        "extras/README.md",
        "extras/tokenizer.json",
    }
    assert json.loads((step_dir / "extras/config.json").read_text()) == {"model_type": "tiny", "layers": 1}
    assert (step_dir / "extras/tokenizer.json").read_text() == '{"version": "1.0", "model": {}}\n'
    assert marker.step == 1 and marker.world_size == WORLD
    assert (marker.staging_node, marker.staging_nodes) == (0, 1)
    assert marker.dtype == "bf16" and marker.metadata == {"run": "test"}
    assert marker.reference_index == {k: "model-00001-of-00001.safetensors" for k in _params(WORLD)}
    want = {
        k: layout.TensorInfo(safetensors_name(v.dtype), tuple(v.shape))
        for k, (v, _) in _params(WORLD).items()
    }
    want["slow.rank1"] = layout.TensorInfo("F32", (SLOW_NUMEL,))
    assert marker.tensors == want
    # every rank's handle returned the marker that rank 0 wrote
    assert recs[0]["marker1"] == recs[1]["marker1"] == marker.to_json()


def test_shards_export_to_exactly_the_saved_weights(run):
    from stagerd.export import export_step

    root, out, _recs, _w = run
    for step in (1, 2):
        result = export_step(root / layout.step_dir_name(step), dtype="keep")
        want = _expected(out, step)
        index = json.loads((result.export_dir / layout.INDEX_NAME).read_text())
        assert set(index["weight_map"]) == set(want)
        for name, ref in want.items():
            with safe_open(result.export_dir / index["weight_map"][name], "pt") as f:
                got = f.get_tensor(name)
            assert got.dtype == ref.dtype and got.shape == ref.shape, name
            assert torch.equal(got.view(torch.uint8), ref.view(torch.uint8)), f"step {step}: {name} differs"
    # the sources changed right after wait_staged(); the export holds the values at save time
    assert not torch.equal(_expected(out, 1)["lm_head.weight"], _expected(out, 2)["lm_head.weight"])


def test_staging_buffers_are_reused(run):
    _root, _out, recs, _w = run
    for rec in recs:
        first, second = rec["buffers"]
        assert first and first == second, "the second save allocated new staging buffers"
        # one buffer per local tensor, plus the DeviceMesh's small rank tensor that staging copies too
        assert 0 <= sum(n for _, n in first) - rec["local_bytes"] <= 64


def test_duplicate_step_is_refused(run):
    root, _out, recs, _w = run
    assert "already committed" in recs[0]["dup"]
    assert "rank 0 refused" in recs[1]["dup"]
    assert layout.read_marker(root / "step-00000001").to_json() == recs[0]["marker1"]  # untouched


def test_optimizer_state_on_some_ranks_only_is_refused(run):
    root, _out, recs, _w = run
    for rec in recs:
        assert "only ranks [0] passed optimizer_state" in rec["optim_mismatch"]
    assert not (root / "step-00000005").exists()


def test_failed_save_leaves_no_marker(run):
    root, _out, recs, _w = run
    for rec in recs:
        assert "File too large" in rec["fail_handle"] and "step 7 was not committed" in rec["fail_handle"]
        assert rec["fail_wait"] == rec["fail_handle"]
        assert rec["committed_after_failure"] is False
        assert rec["retry"] == [7]
    marker = layout.read_marker(root / "step-00000007")
    layout.check_staged_files(root / "step-00000007", marker)


# ---- the process checkpointer, with node-local roots (two "nodes" on one host) ---------------------------


def _node_local_run(rank: int, world: int, init_file: str, base: str) -> None:
    import torch.distributed as dist

    from stagerd import Stager

    os.environ["STAGERD_NODE_ID"] = f"node{rank}"
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        sd = _dtensors(world, rank)
        root = Path(base) / f"node{rank}"
        group = dist.new_group([0, 1])  # an explicit group: the Stager builds its gloo group from it
        with Stager(root, checkpointer="process", process_group=group) as stager:
            assert not stager.topology.shared and stager.topology.num_nodes == 2
            full = _full(sd)
            if rank == 0:
                save_file(full, str(Path(base) / "expected.safetensors"))
            stager.save(sd, 3, extras={"config.json": {"a": 1}}, optimizer_state={"m": sd["lm_head.weight"]})
            stager.wait_staged()
            _train_step(sd, 3)
            stager.wait()
    finally:
        dist.destroy_process_group()


def test_process_checkpointer_with_node_local_roots(tmp_path):
    _spawn(_node_local_run, str(tmp_path))
    markers = [layout.read_marker(tmp_path / f"node{r}" / "step-00000003") for r in range(WORLD)]
    for r, m in enumerate(markers):
        step_dir = tmp_path / f"node{r}" / "step-00000003"
        layout.check_staged_files(step_dir, m)
        assert (m.staging_node, m.staging_nodes, m.world_size) == (r, 2, WORLD)
        assert set(m.tensors) == set(_params(WORLD))
    assert {f.path for f in markers[0].files} == {
        "model/shard-00001-model-00001-of-00001.safetensors",
        "optim/__0_0.distcp",
        "optim/.metadata",
        "extras/config.json",
    }
    assert {f.path for f in markers[1].files} == {
        "model/shard-00002-model-00001-of-00001.safetensors",
        "optim/__1_0.distcp",
    }
    # The two nodes' model shards together are exactly the weights at save time.
    merged = tmp_path / "merged"
    (merged / "model").mkdir(parents=True)
    for r, m in enumerate(markers):
        for f in m.files:
            if f.path.startswith("model/"):
                os.link(tmp_path / f"node{r}" / "step-00000003" / f.path, merged / f.path)
    layout.write_marker(
        merged,
        layout.CommitMarker(
            step=3,
            world_size=WORLD,
            files=tuple(f for m in markers for f in m.files if f.path.startswith("model/")),
            tensors=markers[0].tensors,
        ),
    )
    from stagerd.export import export_step

    result = export_step(merged)
    with safe_open(tmp_path / "expected.safetensors", "pt") as f:
        want = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    index = json.loads((result.export_dir / layout.INDEX_NAME).read_text())
    for name, ref in want.items():
        with safe_open(result.export_dir / index["weight_map"][name], "pt") as f:
            assert torch.equal(f.get_tensor(name).view(torch.uint8), ref.view(torch.uint8)), name


# ---- single process, no torch.distributed: argument checks -----------------------------------------------


def test_single_process_save_and_bad_arguments(tmp_path):
    from stagerd import Stager

    sd = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3)}
    with Stager(tmp_path) as stager:
        assert stager.world_size == 1 and stager.topology.shared
        with pytest.raises(SaveInputError, match=r"'model\.flag' is a bool"):
            stager.save({"model": {"flag": True}}, 1)
        with pytest.raises(DTypeError):
            stager.save(sd, 1, dtype="int3")
        with pytest.raises(SaveInputError, match="not a readable file"):
            stager.save(sd, 1, extras={"config.json": str(tmp_path / "missing.json")})
        with pytest.raises(SaveInputError, match="escapes"):
            stager.save(sd, 1, extras={"../x.json": {}})
        with pytest.raises(ReferenceIndexError):
            stager.save(sd, 1, reference_index=tmp_path / "nope.json")
        assert not (tmp_path / "step-00000001").exists()  # a refused save writes nothing
        marker = stager.save(sd, 1, dtype="fp16").result()
        assert marker.files[0].path == "model/shard-00001-model-00001-of-00001.safetensors"
        assert marker.dtype == "fp16" and marker.tensors == {"w": layout.TensorInfo("F32", (2, 3))}
        with pytest.raises(StepExistsError):
            stager.save(sd, 1)
    with safe_open(tmp_path / "step-00000001" / marker.files[0].path, "pt") as f:
        assert torch.equal(f.get_tensor("w"), sd["w"])


def test_import_stagerd_does_not_import_torch():
    import subprocess
    import sys

    code = (
        "import sys, stagerd; assert 'torch' not in sys.modules; "
        "stagerd.Stager; assert 'torch' in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_example_trains_and_commits(tmp_path):
    import subprocess
    import sys

    from stagerd.export import export_step

    example = Path(__file__).resolve().parents[1] / "examples" / "train_tiny.py"
    final = tmp_path / "final.safetensors"
    root = tmp_path / "ckpt"
    proc = subprocess.run(
        [
            sys.executable,
            str(example),
            "--root",
            str(root),
            "--steps",
            "6",
            "--save-every",
            "3",
            "--dump-final",
            str(final),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "committed [3, 6]" in proc.stdout
    assert [s for s, _ in layout.committed_steps(root)] == [3, 6]
    result = export_step(root / "step-00000006", dtype="keep")
    index = json.loads((result.export_dir / layout.INDEX_NAME).read_text())
    with safe_open(final, "pt") as f:
        names = list(f.keys())
        assert set(index["weight_map"]) == set(names)
        for name in names:
            with safe_open(result.export_dir / index["weight_map"][name], "pt") as g:
                assert torch.equal(g.get_tensor(name), f.get_tensor(name)), name
