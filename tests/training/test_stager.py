"""`stagerd.Stager` in a real 2-rank gloo run: the marker, its files, exact export, refusals, a failed write.

One run (module fixture) saves several steps and records what each rank saw; the tests read that record and
the step directories.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from stagerd.contract import commit_marker, layout
from stagerd.contract.dtypes import safetensors_name
from stagerd.errors import StepExistsError
from tests.export_index import export_index
from tests.gloo import join, launch
from tests.training.gloo_run import (
    SLOW_NUMEL,
    WORLD,
    dtensors,
    full_state,
    local_nbytes,
    params,
    record,
    slow_tensor,
    train_step,
)


def _main_run(rank: int, world: int, init_file: str, root: str, out: str) -> None:
    import torch.distributed as dist

    from stagerd import Stager
    from stagerd.errors import SaveError, SaveInputError

    join(rank, world, init_file)
    out_p, rec = Path(out), {}
    try:
        sd = dtensors(world, rank)
        if rank == 1:
            sd["slow.rank1"] = slow_tensor()
        optim = {"state": {k: {"exp_avg": torch.zeros_like(v)} for k, v in sd.items()}, "lr": 0.1}
        extras = {
            "config.json": {"model_type": "tiny", "layers": 1},
            "README.md": b"# tiny\n",
            "tokenizer.json": str(out_p / "tokenizer.json"),
        }
        ref = {k: "model.safetensors" for k in params(world)}
        stager = Stager(root)
        buffers = []
        for step in (1, 2):
            full = full_state({k: v for k, v in sd.items() if k != "slow.rank1"})
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
            train_step(sd, step)  # mutates the sources while the write is in flight
            rec[f"marker{step}"] = handle.result().to_json()
        rec["buffers"] = [sorted(b.items()) for b in buffers]
        rec["local_bytes"] = sum(local_nbytes(v) for v in sd.values()) + sum(
            local_nbytes(t["exp_avg"]) for t in optim["state"].values()
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
        record(out_p, rank, rec)
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
                marker = commit_marker.read_marker(self.step_dir)
                for f in marker.files:
                    p = self.step_dir / f.path
                    if not p.is_file() or p.stat().st_size != f.size:
                        self.mismatch_at_marker.append(f.path)
            time.sleep(0.001)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("stage-root")
    out = tmp_path_factory.mktemp("stage-out")
    (out / "tokenizer.json").write_text('{"version": "1.0", "model": {}}\n')
    watcher = _Watcher(root / "step-00000001")
    watcher.start()
    try:
        launch(_main_run, str(root), str(out))
    finally:
        watcher.stop.set()
        watcher.join()
    recs = [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]
    return root, out, recs, watcher


def _expected(out: Path, step: int) -> dict[str, torch.Tensor]:
    with safe_open(out / f"expected-{step}.safetensors", "pt") as f:
        want = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    want["slow.rank1"] = slow_tensor()
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
    marker = commit_marker.read_marker(step_dir)
    commit_marker.check_staged_files(step_dir, marker)
    on_disk = {
        str(p.relative_to(step_dir)): p.stat().st_size
        for p in step_dir.rglob("*")
        if p.is_file() and p.name != layout.MARKER_NAME
    }
    assert {f.path: f.size for f in marker.files} == on_disk
    assert set(on_disk) == {
        "model/shard-00001-model-00001-of-00001.safetensors",
        "model/shard-00002-model-00001-of-00001.safetensors",
        "optim/shard-00001-00001.safetensors",
        "optim/shard-00002-00001.safetensors",
        "optim/shard-00001.objects.pt",
        "optim/shard-00002.objects.pt",
        "extras/config.json",
        "extras/README.md",
        "extras/tokenizer.json",
    }
    assert json.loads((step_dir / "extras/config.json").read_text()) == {"model_type": "tiny", "layers": 1}
    assert (step_dir / "extras/tokenizer.json").read_text() == '{"version": "1.0", "model": {}}\n'
    assert marker.step == 1 and marker.world_size == WORLD
    assert (marker.staging_node, marker.staging_nodes) == (0, 1)
    assert marker.dtype == "bf16" and marker.metadata == {"run": "test"}
    assert marker.reference_index == {k: "model.safetensors" for k in params(WORLD)}
    want = {
        k: commit_marker.TensorInfo(safetensors_name(v.dtype), tuple(v.shape))
        for k, (v, _) in params(WORLD).items()
    }
    want["slow.rank1"] = commit_marker.TensorInfo("F32", (SLOW_NUMEL,))
    assert marker.tensors == want
    # every rank's handle returned the marker that rank 0 wrote
    assert recs[0]["marker1"] == recs[1]["marker1"] == marker.to_json()


def test_shards_export_to_exactly_the_saved_weights(run):
    from stagerd.engine.export import export_step

    root, out, _recs, _w = run
    for step in (1, 2):
        result = export_step(root / layout.step_dir_name(step), dtype="keep")
        want = _expected(out, step)
        index = export_index(result.export_dir)
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
    assert commit_marker.read_marker(root / "step-00000001").to_json() == recs[0]["marker1"]  # untouched


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
    marker = commit_marker.read_marker(root / "step-00000007")
    commit_marker.check_staged_files(root / "step-00000007", marker)


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
    index = export_index(result.export_dir)
    with safe_open(final, "pt") as f:
        names = list(f.keys())
        assert set(index["weight_map"]) == set(names)
        for name in names:
            with safe_open(result.export_dir / index["weight_map"][name], "pt") as g:
                assert torch.equal(g.get_tensor(name), f.get_tensor(name)), name
