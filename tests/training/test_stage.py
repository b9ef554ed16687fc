"""`stagerd.Stager` in real gloo multi-process runs: the marker, its files, bit-exact export, failures.

One 2-rank run (module fixture) saves several steps and records what each rank saw; the tests read that
record and the step directories. A second run covers the process checkpointer with node-local roots.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from stagerd.contract import layout
from stagerd.contract.dtypes import safetensors_name
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


def _spawn_bounded(fn, *args, deadline_s: float = 90.0) -> None:
    """Like `_spawn`, but a run still going at the deadline is killed and fails the test (a hang)."""
    import torch.multiprocessing as mp

    fd, init_file = tempfile.mkstemp(prefix="stagerd-test-gloo-")
    os.close(fd)
    os.unlink(init_file)
    ctx = mp.start_processes(
        fn, args=(WORLD, init_file, *args), nprocs=WORLD, start_method="spawn", join=False
    )
    end = time.monotonic() + deadline_s
    try:
        while not ctx.join(timeout=max(0.1, end - time.monotonic())):
            if time.monotonic() >= end:
                alive = [r for r, p in enumerate(ctx.processes) if p.is_alive()]
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                raise AssertionError(f"ranks {alive} still running after {deadline_s:.0f} s: a hang")
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
    from stagerd.engine.export import export_step

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
            # The first save fails before the write on node 1 (its leader cannot clear a stale step dir),
            # after the checkpoint daemons' rendezvous that this first save runs on every rank.
            if rank == 1:
                (root / "step-00000002").mkdir()
                (root / "step-00000002" / "model").write_text("not a directory")
            failed = _attempt(stager, sd, 2)
            (Path(base) / f"failed{rank}.json").write_text(json.dumps(failed))
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
    _spawn_bounded(_node_local_run, str(tmp_path))
    for r in range(WORLD):
        failed = json.loads((tmp_path / f"failed{r}.json").read_text())
        assert failed["save"] is None and failed["wait"] == failed["handle"]
        assert "step 2 was not committed" in failed["handle"], failed["handle"]
        assert "NotADirectoryError" in failed["handle"] and "(reported by rank 1)" in failed["handle"]
        assert not layout.is_committed(tmp_path / f"node{r}" / "step-00000002")
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
    from stagerd.engine.export import export_step

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

    from stagerd.engine.export import export_step

    example = Path(__file__).resolve().parents[2] / "examples" / "train_tiny.py"
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


# ---- views, tied weights, non-contiguous and 0-dim local tensors (issue 3 follow-up, bug 1) -------------

H = 8  # hidden size of the view test's tensors; divisible by WORLD


def _view_fulls() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return {
        "model.layers.0.self_attn.q_proj.weight": torch.randn(H, H, generator=g),
        "model.layers.0.self_attn.k_proj.weight": torch.randn(H, H, generator=g),
        "model.layers.0.self_attn.v_proj.weight": torch.randn(H, H, generator=g),
        "model.layers.0.mlp.up_proj.weight": torch.randn(2 * H, H, generator=g),
        "model.layers.0.mlp.down_proj.weight": torch.randn(H, 2 * H, generator=g),
        "model.embed_tokens.weight": torch.randn(4 * H, H, generator=g),
        "model.norm.weight": torch.randn(H, generator=g),
    }


def _view_state(world: int, rank: int) -> tuple[dict[str, torch.Tensor], dict[str, Any], list[torch.Tensor]]:
    """A state dict whose local shards are views, as real training produces them.

    - q/k/v: one fused local QKV block per rank, split into three views (offsets 0, n, 2n);
    - up_proj, embed_tokens: FSDP2-style, views into one flat per-rank buffer;
    - down_proj: a non-contiguous local (the transpose of a contiguous buffer);
    - lm_head is tied: the very same DTensor as embed_tokens, under a second key;
    - 0-dim tensors: a replicated DTensor scalar and two plain scalars; two plain views of one buffer.
    Returns (model state dict, optimizer state, the base buffers that an in-place "step" mutates).
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    mesh = init_device_mesh("cpu", (world,))
    fulls = _view_fulls()

    def chunk(name: str, dim: int = 0) -> torch.Tensor:
        return torch.chunk(fulls[name], world, dim=dim)[rank]

    def dt(local: torch.Tensor, name: str, placements=None) -> torch.Tensor:
        full = fulls[name]
        return DTensor.from_local(
            local, mesh, placements or [Shard(0)], run_check=False, shape=full.shape, stride=full.stride()
        )

    qkv = torch.cat([chunk(f"model.layers.0.self_attn.{p}_proj.weight") for p in "qkv"])
    n = H // world
    flat = torch.empty(
        chunk("model.layers.0.mlp.up_proj.weight").numel() + chunk("model.embed_tokens.weight").numel()
    )
    up = flat[: 2 * H // world * H].view(2 * H // world, H)
    emb = flat[2 * H // world * H :].view(4 * H // world, H)
    up.copy_(chunk("model.layers.0.mlp.up_proj.weight"))
    emb.copy_(chunk("model.embed_tokens.weight"))
    down_base = chunk("model.layers.0.mlp.down_proj.weight").t().contiguous()  # (2H, H/world)
    down = down_base.t()
    assert not down.is_contiguous()
    pair = torch.arange(10, dtype=torch.float32)
    tied = dt(emb, "model.embed_tokens.weight")
    sd: dict[str, torch.Tensor] = {
        "model.layers.0.self_attn.q_proj.weight": dt(qkv[:n], "model.layers.0.self_attn.q_proj.weight"),
        "model.layers.0.self_attn.k_proj.weight": dt(
            qkv[n : 2 * n], "model.layers.0.self_attn.k_proj.weight"
        ),
        "model.layers.0.self_attn.v_proj.weight": dt(qkv[2 * n :], "model.layers.0.self_attn.v_proj.weight"),
        "model.layers.0.mlp.up_proj.weight": dt(up, "model.layers.0.mlp.up_proj.weight"),
        "model.layers.0.mlp.down_proj.weight": dt(down, "model.layers.0.mlp.down_proj.weight"),
        "model.embed_tokens.weight": tied,
        "lm_head.weight": tied,
        "model.norm.weight": dt(fulls["model.norm.weight"].clone(), "model.norm.weight", [Replicate()]),
        "model.scale": DTensor.from_local(torch.tensor(0.5), mesh, [Replicate()], run_check=False),
        "model.step_count": torch.tensor(3, dtype=torch.int64),
        "model.layers.0.a.bias": pair[:5],
        "model.layers.0.b.bias": pair[5:],
    }
    moments = torch.zeros(flat.numel())
    optim = {
        "state": {
            "up": {"exp_avg": dt(moments[: up.numel()].view_as(up), "model.layers.0.mlp.up_proj.weight")},
            "emb": {"exp_avg": dt(moments[up.numel() :].view_as(emb), "model.embed_tokens.weight")},
            "step": torch.tensor(1.0),
        },
        "param_groups": [{"lr": 0.1, "params": ["up", "emb"]}],
    }
    return sd, optim, [qkv, flat, down_base, pair, moments, sd["model.scale"].to_local()]


def _distinct_storage_bytes(tensors) -> int:
    seen = {}
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        s = local.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def _views_run(rank: int, world: int, init_file: str, root: str, out: str) -> None:
    import torch.distributed as dist

    from stagerd import Stager

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    out_p, rec = Path(out), {"buffers": []}
    try:
        sd, optim, bases = _view_state(world, rank)
        with Stager(root, checkpointer="thread") as stager:
            for step in (1, 2):
                full = {
                    k: v.full_tensor().clone() if hasattr(v, "full_tensor") else v.clone()
                    for k, v in sd.items()
                }
                if rank == 0:
                    save_file(full, str(out_p / f"expected-{step}.safetensors"))
                handle = stager.save(sd, step, optimizer_state=optim)
                stager.wait_staged()
                rec["buffers"].append(sorted(stager.staging_buffers().items()))
                with torch.no_grad():
                    for b in bases:  # an in-place "optimizer step" through the base buffers
                        b.mul_(2).add_(step)
                rec[f"marker{step}"] = handle.result().to_json()
        optim_tensors = [
            optim["state"]["up"]["exp_avg"],
            optim["state"]["emb"]["exp_avg"],
            optim["state"]["step"],
        ]
        rec["storage_bytes"] = _distinct_storage_bytes(list(sd.values()) + optim_tensors)
        _record(out_p, rank, rec)
    finally:
        dist.destroy_process_group()


def test_views_tied_noncontiguous_and_scalars_save_exactly(tmp_path):
    from stagerd.engine.export import export_step

    root, out = tmp_path / "root", tmp_path / "out"
    out.mkdir()
    _spawn_bounded(_views_run, str(root), str(out))
    recs = [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]
    for step in (1, 2):
        step_dir = root / layout.step_dir_name(step)
        marker = layout.read_marker(step_dir)
        layout.check_staged_files(step_dir, marker)
        assert {"lm_head.weight", "model.embed_tokens.weight", "model.scale"} <= set(marker.tensors)
        assert marker.tensors["model.scale"] == layout.TensorInfo("F32", ())
        result = export_step(step_dir, dtype="keep")
        index = json.loads((result.export_dir / layout.INDEX_NAME).read_text())
        with safe_open(out / f"expected-{step}.safetensors", "pt") as f:
            want = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
        assert set(index["weight_map"]) == set(want)
        for name, ref in want.items():
            with safe_open(result.export_dir / index["weight_map"][name], "pt") as f:
                got = f.get_tensor(name)
            assert got.dtype == ref.dtype and got.shape == ref.shape, name
            same = torch.equal(got.reshape(-1).view(torch.uint8), ref.reshape(-1).view(torch.uint8))
            assert same, f"step {step}: {name} differs"
    with (
        safe_open(out / "expected-1.safetensors", "pt") as f1,
        safe_open(out / "expected-2.safetensors", "pt") as f2,
    ):
        assert not torch.equal(
            f1.get_tensor("model.layers.0.self_attn.k_proj.weight"),
            f2.get_tensor("model.layers.0.self_attn.k_proj.weight"),
        )
    for rec in recs:
        first, second = rec["buffers"]
        assert first == second, "the second save allocated new staging buffers"
        # one host buffer per source storage: views of one storage share it, nothing else is copied
        assert sum(n for _, n in first) == rec["storage_bytes"]


# ---- one rank's save fails, before, during or after its write: no rank hangs (issue 3 follow-up, bug 2) ----

BIG_NUMEL = 24 << 20  # 96 MiB of fp32: more than the address space a failing rank has left while staging


def _limit_address_space(margin: int) -> None:
    """Let this process map only `margin` more bytes: the next large host allocation fails (ENOMEM)."""
    with open("/proc/self/status") as f:
        vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    resource.setrlimit(resource.RLIMIT_AS, (vm + margin, resource.RLIM_INFINITY))


def _unlimit() -> None:
    for res in (resource.RLIMIT_AS, resource.RLIMIT_FSIZE):
        resource.setrlimit(res, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))


def _attempt(stager, *args, **kwargs) -> dict:
    """Save, then record what save(), wait_staged(), the handle and wait() each said."""
    from stagerd.errors import SaveError

    out: dict[str, str | None] = {"save": None, "staged": None, "handle": None, "wait": None}
    try:
        handle = stager.save(*args, **kwargs)
    except SaveError as e:
        out["save"] = str(e)
        handle = None
    if handle is not None:
        try:
            handle.wait_staged()
        except SaveError as e:
            out["staged"] = str(e)
        try:
            handle.result()
        except SaveError as e:
            out["handle"] = str(e)
    try:
        stager.wait()
    except SaveError as e:
        out["wait"] = str(e)
    return out


def _attempt_result(handle) -> str | None:
    from stagerd.errors import SaveError

    try:
        handle.result()
    except SaveError as e:
        return str(e)
    return None


def _failures_run(rank: int, world: int, init_file: str, root: str, out: str) -> None:
    import torch.distributed as dist

    from stagerd import Stager
    from stagerd.errors import SaveError

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    root_p, rec = Path(root), {}
    try:
        sd = _dtensors(world, rank)
        big = torch.ones(BIG_NUMEL)  # allocated now, while there is room
        with Stager(root, checkpointer="thread") as stager:
            # before the write: rank 1 cannot allocate its host staging buffer (model state)
            if rank == 1:
                _limit_address_space(32 << 20)
            rec["stage_r1"] = _attempt(stager, {**sd, "big.rank1": big} if rank == 1 else sd, 11)
            _unlimit()
            # before the write: rank 0 cannot allocate its host staging buffer (optimizer state)
            optim = {f"m{rank}": big if rank == 0 else torch.zeros(4)}  # rank-local keys: no dedup
            if rank == 0:
                _limit_address_space(32 << 20)
            rec["stage_r0_optim"] = _attempt(stager, sd, 12, optimizer_state=optim)
            _unlimit()
            # before the write, after the agreement: rank 0 cannot clear a stale step directory
            if rank == 0:
                (root_p / "step-00000013").mkdir()
                (root_p / "step-00000013" / "model").write_text("not a directory")
            rec["clear_r0"] = _attempt(stager, sd, 13)
            if rank == 0:
                (root_p / "step-00000013" / "model").unlink()
            # during the write: the coordinator's shard hits the file size limit
            if rank == 0:
                resource.setrlimit(resource.RLIMIT_FSIZE, (1024, resource.RLIM_INFINITY))
            rec["write_r0"] = _attempt(stager, sd, 14)
            _unlimit()
            # after its model write: rank 1's optimizer shard hits the file size limit
            if rank == 1:
                resource.setrlimit(resource.RLIMIT_FSIZE, (256 << 10, resource.RLIM_INFINITY))
            optim = {f"m{rank}": torch.ones(1 << 20) if rank == 1 else torch.zeros(4)}
            rec["optim_write_r1"] = _attempt(stager, sd, 15, optimizer_state=optim)
            _unlimit()
            # after every DCP write: rank 0's extras hit the file size limit
            if rank == 0:
                resource.setrlimit(resource.RLIMIT_FSIZE, (256 << 10, resource.RLIM_INFINITY))
            rec["extras_r0"] = _attempt(stager, sd, 16, extras={"blob.bin": bytes(1 << 20)})
            _unlimit()
            # after everything was written: rank 0 cannot put the marker in place (a directory has its name)
            if rank == 0:
                (root_p / "step-00000018" / layout.MARKER_NAME).mkdir(parents=True)
                (root_p / "step-00000018" / layout.MARKER_NAME / "x").write_text("")
            rec["marker_r0"] = _attempt(stager, sd, 18)
            rec["committed"] = {
                s: layout.is_committed(root_p / layout.step_dir_name(s)) for s in range(11, 19)
            }
            # every rank is still in step: the same steps save and commit now
            rec["retry"] = [stager.save(sd, s).result().step for s in (11, 13)]
            # a rank that dies while its write is in flight: the survivor's save fails, it does not hang
            handle = stager.save({**sd, "slow.rank1": _slow_tensor()} if rank == 1 else sd, 17)
            if rank == 1:
                _record(Path(out), rank, rec)
                os._exit(0)
            t0 = time.monotonic()
            rec["peer_died"] = _attempt_result(handle)
            rec["peer_died_s"] = time.monotonic() - t0
            rec["peer_died_committed"] = layout.is_committed(root_p / layout.step_dir_name(17))
            with contextlib.suppress(SaveError):
                stager.wait()
        _record(Path(out), rank, rec)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def failures(tmp_path_factory):
    root = tmp_path_factory.mktemp("fail-root")
    out = tmp_path_factory.mktemp("fail-out")
    _spawn_bounded(_failures_run, str(root), str(out))
    return root, [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


@pytest.mark.parametrize(
    ("case", "failing_rank", "cause"),
    [
        ("stage_r1", 1, "can't allocate memory"),
        ("stage_r0_optim", 0, "can't allocate memory"),
        ("clear_r0", 0, "NotADirectoryError"),
        ("write_r0", 0, "File too large"),
        ("optim_write_r1", 1, "writing optim/ failed: rank 1"),  # torch's zip writer words it its own way
        ("extras_r0", 0, "File too large"),
        ("marker_r0", 0, "writing the commit marker failed: IsADirectoryError"),
    ],
)
def test_one_rank_failing_fails_the_save_on_every_rank(failures, case, failing_rank, cause):
    _root, recs = failures
    for rank, rec in enumerate(recs):
        got = rec[case]
        assert got["save"] is None, f"rank {rank}: save() itself raised: {got['save']}"
        assert got["handle"] is not None, f"rank {rank}: the handle of a failed save succeeded"
        assert "was not committed" in got["handle"] and cause in got["handle"], got["handle"]
        assert f"rank {failing_rank}" in got["handle"], got["handle"]
        assert got["wait"] == got["handle"]
        if case.startswith("stage_") and rank == failing_rank:
            assert got["staged"] is not None and cause in got["staged"]
        else:
            assert got["staged"] is None


def test_a_dead_rank_fails_the_save_on_the_survivor(failures):
    _root, recs = failures
    rec = recs[0]
    assert rec["peer_died"] is not None, "the survivor's save succeeded without its peer"
    assert "step 17 was not committed: lost contact with the other ranks" in rec["peer_died"]
    assert rec["peer_died_s"] < 30  # gloo notices the closed connection; no timeout was waited out
    assert rec["peer_died_committed"] is False


def test_failed_saves_leave_no_marker_and_the_ranks_stay_in_step(failures):
    root, recs = failures
    for rec in recs:
        assert rec["committed"] == {str(s): False for s in range(11, 19)}
        assert rec["retry"] == [11, 13]
    for s in (11, 13):
        layout.check_staged_files(
            root / layout.step_dir_name(s), layout.read_marker(root / layout.step_dir_name(s))
        )
