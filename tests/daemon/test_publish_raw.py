"""`stagerd watch --publish-raw` (issue 13): the raw step to `PREFIX/raw/step-N/` as its own journal lane.

Real `stagerd watch --once` processes on real DCP shards and a file:// sink: the raw tree and its manifest,
a raw lane that runs while the export is still under way, idempotence after the journal is lost, and a
failing raw lane that keeps local retention away from its step.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from pathlib import Path

import pytest

from stagerd.contract import commit_marker, layout
from stagerd.contract.commit_marker import TensorInfo
from stagerd.contract.dtypes import safetensors_name
from stagerd.daemon.journal import Journal
from tests.cli_helpers import run_cli
from tests.daemon_helpers import fast_flags
from tests.dcp_fixtures import commit_step

pytestmark = pytest.mark.slow


def _root(tmp_path: Path, model_src: Path, steps: tuple[int, ...] = (1, 2)) -> Path:
    root = tmp_path / "root"
    root.mkdir()
    for s in steps:
        step_dir = root / layout.step_dir_name(s)
        (step_dir / "optim").mkdir(parents=True)
        (step_dir / "optim" / "__0_0.distcp").write_bytes(bytes(range(256)) * (s + 1))
        (step_dir / "extras").mkdir()
        (step_dir / "extras" / "loader.json").write_text(json.dumps({"pos": s}))
        shutil.copytree(model_src, step_dir / "model")
        commit_step(step_dir, 2)
    return root


def _watch(root: Path, sink: Path, *args: str, env: dict | None = None):
    return run_cli(
        ["watch", root, "--sink", sink.as_uri(), "--publish-raw", "--once", *fast_flags(), *args],
        env=env,
        timeout=180,
    )


def _lanes(root: Path) -> dict[tuple[int, str], object]:
    j = Journal.open_readonly(root)
    try:
        return {(ln.step, ln.sink): ln for ln in j.lanes()}
    finally:
        j.close()


def _events(root: Path):
    j = Journal.open_readonly(root)
    try:
        return j.events()
    finally:
        j.close()


def test_every_committed_step_goes_raw_with_its_manifest_last(tmp_path, dcp_mixed2):
    root, sink = _root(tmp_path, dcp_mixed2[0]), tmp_path / "sink"
    expected = {s: dict(_local_files(root / layout.step_dir_name(s))) for s in (1, 2)}
    r = _watch(root, sink, "--keep-last", "0")
    assert r.returncode == 0, r.stderr[-3000:]
    raw_key = f"raw:{sink.as_uri()}"
    lanes = _lanes(root)
    for s in (1, 2):
        raw = sink / "raw" / layout.step_dir_name(s)
        manifest = json.loads((raw / layout.MANIFEST_NAME).read_text())
        assert manifest["metadata"] == {"raw": True} and manifest["step"] == s
        got = {f["path"]: (f["size"], f["sha256"]) for f in manifest["files"]}
        assert got == expected[s]
        for rel, (size, sha) in got.items():
            assert hashlib.sha256((raw / rel).read_bytes()).hexdigest() == sha and size
        assert not (raw / "export").exists() and not (raw / layout.EXPORT_OPTIONS_NAME).exists()
        assert lanes[(s, raw_key)].state == "published"
        assert (sink / layout.step_dir_name(s) / layout.MANIFEST_NAME).exists()  # the export too
        assert not (root / layout.step_dir_name(s)).exists()  # retention ran after both lanes
    assert (sink / "raw" / "latest").read_text() == layout.step_dir_name(2)
    published = [e for e in _events(root) if e.sink == raw_key and e.to_state == "published"]
    assert sorted(e.step for e in published) == [1, 2]  # exactly once each


def _local_files(step_dir: Path):
    marker = commit_marker.read_marker(step_dir)
    for rel in [f.path for f in marker.files] + [layout.MARKER_NAME]:
        data = (step_dir / rel).read_bytes()
        yield rel, (len(data), hashlib.sha256(data).hexdigest())


def test_raw_lane_runs_before_the_export_and_is_idempotent(tmp_path, dcp_mixed2):
    root, sink = _root(tmp_path, dcp_mixed2[0], (1,)), tmp_path / "sink"
    env = {"STAGERD_TEST_PAUSE_AT": "export", "STAGERD_TEST_PAUSE_SECONDS": "3"}
    r = _watch(root, sink, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    raw_key = f"raw:{sink.as_uri()}"
    order = [(e.sink, e.to_state) for e in _events(root) if e.to_state in ("exported", "published")]
    assert order.index((raw_key, "published")) < order.index((None, "exported")), order
    # The journal lost: the next run finds the raw step on the sink and sends nothing.
    shutil.rmtree(root / layout.STATE_DIR)
    before = {p: p.stat().st_mtime_ns for p in (sink / "raw").rglob("*") if p.is_file()}
    r = _watch(root, sink)
    assert r.returncode == 0, r.stderr[-3000:]
    lane = _lanes(root)[(1, raw_key)]
    assert lane.state == "published" and lane.skipped == 1 and lane.bytes_uploaded == 0
    assert {p: p.stat().st_mtime_ns for p in (sink / "raw").rglob("*") if p.is_file()} == before


def test_retention_never_deletes_a_step_whose_raw_publish_failed(tmp_path, dcp_mixed2):
    root, sink = _root(tmp_path, dcp_mixed2[0], (1, 2)), tmp_path / "sink"
    sink.mkdir()
    (sink / "raw").write_text("not a directory")  # every raw upload fails
    r = _watch(root, sink, "--keep-last", "0", "--max-attempts", "1")
    assert r.returncode == 1, r.stderr[-3000:]
    assert "raw:" in r.stdout
    lanes = _lanes(root)
    for s in (1, 2):
        assert lanes[(s, sink.as_uri())].state == "published"  # the export lane went on
        assert lanes[(s, f"raw:{sink.as_uri()}")].state in ("failed", "quarantined")
        assert layout.is_committed(root / layout.step_dir_name(s))  # kept: its raw copy is not out


def test_a_step_its_node_cannot_export_alone_still_goes_raw(tmp_path, dcp_mixed2):
    root, sink = tmp_path / "root", tmp_path / "sink"
    step_dir = root / layout.step_dir_name(7)
    shutil.copytree(dcp_mixed2[0], step_dir / "model")
    for shard in sorted((step_dir / "model").glob("*.safetensors"))[1:]:
        shard.unlink()  # node-local staging: this node holds rank 0's shard only
    tensors = {k: TensorInfo(safetensors_name(v.dtype), tuple(v.shape)) for k, v in dcp_mixed2[1].items()}
    commit_step(step_dir, 2, staging_node=0, staging_nodes=2, tensors=tensors)
    r = _watch(root, sink, "--max-attempts", "1", "--fleet-wait-seconds", "1")
    assert r.returncode == 1  # the fleet export waits for node 1 (FleetWaitError): not published
    assert "waiting for node 1" in r.stdout + r.stderr
    lanes = _lanes(root)
    assert lanes[(7, f"raw:{sink.as_uri()}")].state == "published"
    node = sink / "raw" / layout.step_dir_name(7) / "node-00000-of-00002"
    assert (node / layout.MANIFEST_NAME).is_file() and (node / layout.MARKER_NAME).is_file()


@pytest.mark.parametrize("kills", [("publish.done:1",), ("publish.done:2", "publish.done:1")])
def test_a_daemon_killed_after_a_raw_publish_records_it_once(tmp_path, dcp_mixed2, kills):
    root, sink = _root(tmp_path, dcp_mixed2[0], (1,)), tmp_path / "sink"
    for point in kills:
        r = _watch(root, sink, env={"STAGERD_CRASH_AT": point})
        assert r.returncode == -9, r.stderr[-2000:]
    manifest = sink / "raw" / layout.step_dir_name(1) / layout.MANIFEST_NAME
    r = _watch(root, sink)
    assert r.returncode == 0, r.stderr[-3000:]
    published = [(e.step, e.sink) for e in _events(root) if e.sink and e.to_state == "published"]
    assert sorted(published) == sorted([(1, sink.as_uri()), (1, f"raw:{sink.as_uri()}")])  # once each
    assert json.loads(manifest.read_text())["step"] == 1


def test_restore_is_refused_while_a_daemon_watches_root(tmp_path, dcp_mixed2):
    from tests.cli_helpers import start_cli

    root, sink = _root(tmp_path, dcp_mixed2[0], (1,)), tmp_path / "sink"
    assert _watch(root, sink).returncode == 0
    shutil.rmtree(root / layout.step_dir_name(1))
    daemon = start_cli(["watch", root, "--sink", sink.as_uri(), *fast_flags()])
    try:
        deadline = time.monotonic() + 30
        while not (root / layout.STATE_DIR / "lock").read_text().strip() and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(0.5)
        r = run_cli(["restore", sink.as_uri(), root, "--step", "1"])
        assert r.returncode == 2 and "LockError" in r.stderr, r.stderr
        assert not (root / layout.step_dir_name(1)).exists()
    finally:
        daemon.terminate()
        daemon.wait(30)
    r = run_cli(["restore", sink.as_uri(), root, "--step", "1"])
    assert r.returncode == 0, r.stderr
