"""Remote retention (issue 13): the pure plan, `stagerd prune` on file:// and S3, kills mid-prune, and the
daemon's `--remote-keep-last` after each publish."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from stagerd.contract import layout
from stagerd.sinks.fetch import RemoteStore
from stagerd.sinks.fsspec import FsspecSink
from stagerd.sinks.prune import Lease, Policy, RemoteStep, parse_policy, plan_prune
from tests.cli_helpers import run_cli
from tests.dcp_fixtures import commit_step
from tests.s3server import s3, s3_server  # noqa: F401  (fixtures)


def _fates(steps, policy, latest, restoring=frozenset()):
    return {d.step: d.delete for d in plan_prune(steps, policy, latest, set(restoring))}


def test_plan_keeps_latest_unverified_restoring_newest_and_multiples():
    steps = [RemoteStep(s, True) for s in range(1, 8)] + [RemoteStep(8, False)]
    got = _fates(steps, Policy(keep_last=2, keep_every=3), latest=7, restoring={1})
    assert got == {1: False, 2: True, 3: False, 4: True, 5: True, 6: False, 7: False, 8: False}
    # latest is never deleted, even where the policy would drop it
    assert _fates([RemoteStep(1, True), RemoteStep(2, True)], Policy(keep_last=1), latest=1) == {
        1: False,
        2: False,
    }
    # nothing older goes until a newer step is complete: the newest complete step is kept
    assert _fates([RemoteStep(1, True), RemoteStep(2, False)], Policy(keep_last=1), latest=1) == {
        1: False,
        2: False,
    }
    # a killed prune's step without manifest is finished; one with its manifest still there is judged anew
    got = _fates([RemoteStep(1, False, pruning=True), RemoteStep(2, True), RemoteStep(3, True)], Policy(1), 3)
    assert got == {1: True, 2: True, 3: False}
    # keep_every alone keeps its multiples, latest's step and the newest complete one: nothing else
    got = _fates([RemoteStep(s, True) for s in range(1, 12)], Policy(keep_every=5), latest=11)
    assert {s for s, gone in got.items() if not gone} == {5, 10, 11}
    with pytest.raises(Exception, match="keep_last must be 1 or more"):
        Policy(keep_last=0)
    assert parse_policy("last=3,every=1000") == Policy(3, 1000) and parse_policy("every=5") == Policy(None, 5)


def _publish(sink: FsspecSink, work: Path, steps) -> None:
    for s in steps:
        d = work / layout.step_dir_name(s)
        (d / "model").mkdir(parents=True)
        (d / "model" / "shard.safetensors").write_bytes(bytes([s]) * 1000)
        (d / "optim").mkdir()
        (d / "optim" / ".metadata").write_bytes(b"m" * s)
        commit_step(d, 1)
        sink.publish_raw(d, s)
        exp = work / f"export-{s}"
        exp.mkdir()
        (exp / "model.safetensors").write_bytes(bytes([s]) * 500)
        sink.publish(exp, s)


def _steps(sink_dir: Path, tree: str = "") -> list[int]:
    base = sink_dir / tree
    return sorted(s for p in base.glob("step-*") if (s := layout.parse_step_dir(p.name)) is not None)


def _valid(sink_dir: Path) -> None:
    """No manifest whose files are gone: what a reader must never see."""
    for m in sink_dir.rglob(layout.MANIFEST_NAME):
        for f in json.loads(m.read_text())["files"]:
            assert (m.parent / f["path"]).stat().st_size == f["size"], (m, f)


@pytest.fixture
def sink_dir(tmp_path) -> Path:
    d = tmp_path / "sink"
    _publish(FsspecSink.from_url(d.as_uri()), tmp_path / "work", range(1, 7))
    return d


def test_prune_dry_run_then_prune_on_file_sink(sink_dir):
    url = sink_dir.as_uri()
    (sink_dir / "step-00000001" / layout.MANIFEST_NAME).unlink()  # step 1: as if its upload never finished
    r = run_cli(["prune", url, "--keep-last", "2", "--keep-every", "3", "--dry-run"])
    assert r.returncode == 0, r.stderr
    assert "would delete" in r.stdout and "no manifest: not published or not verified" in r.stdout
    assert _steps(sink_dir) == [1, 2, 3, 4, 5, 6] and _steps(sink_dir, "raw") == [1, 2, 3, 4, 5, 6]
    store = RemoteStore.open(url)
    with Lease(store, 2):  # a restore is reading step 2
        r = run_cli(["prune", url, "--keep-last", "2", "--keep-every", "3"])
    store.close()
    assert r.returncode == 0, r.stderr
    assert _steps(sink_dir) == [1, 2, 3, 5, 6]
    assert _steps(sink_dir, "raw") == [2, 3, 5, 6]
    assert (sink_dir / "latest").read_text() == "step-00000006"
    assert not (sink_dir / "restoring").exists()  # the lease is gone, and so is its empty directory
    _valid(sink_dir)


def test_the_hub_and_no_policy_are_refused(sink_dir):
    r = run_cli(["prune", "hf://org/repo", "--keep-last", "1"])
    assert r.returncode == 2 and "the Hub is not pruned" in r.stderr
    r = run_cli(["prune", sink_dir.as_uri()])
    assert r.returncode == 2 and "--keep-last N and/or --keep-every M" in r.stderr


@pytest.mark.parametrize("url", ["s3:/bkt/run", "file://exports/run", "S3://bkt/run", "memory://bkt/run"])
def test_a_mistyped_prune_url_is_refused_and_nothing_is_made(tmp_path, monkeypatch, capsys, url):
    """Before the fix, `stagerd prune s3:/bkt/run --keep-last 1 --dry-run` printed "0 step(s) would delete"
    (exit 0: retention looked applied) and made the directories `s3:/bkt/run` under the working directory
    (and a file:// prune of a directory that does not exist made it: now a ConfigError too)."""
    from stagerd.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["prune", url, "--keep-last", "1", "--dry-run"]) == 2
    assert "ConfigError" in capsys.readouterr().err
    absent = tmp_path / "absent"  # a typo too: never a prune of nothing, never made
    assert main(["prune", absent.as_uri(), "--keep-last", "1", "--dry-run"]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("command", ["prune", "restore"])
@pytest.mark.parametrize("url", ["ftp://127.0.0.1:1/x", "hdfs://127.0.0.1:1/x"], ids=["ftp", "hdfs"])
def test_a_store_that_cannot_be_reached_on_open_is_a_sink_error(tmp_path, capsys, command, url):
    """Before the fix, prune and restore let the store's own error out (ConnectionRefusedError, pyarrow's
    OSError for a missing libjvm): a traceback, exit 1, where publish and watch said SinkError, exit 3."""
    from stagerd.cli import main

    args = ["--keep-last", "1", "--dry-run"] if command == "prune" else [str(tmp_path / "n")]
    assert main([command, url, *args]) == 3
    err = capsys.readouterr().err
    assert f"SinkError: cannot reach sink {url}" in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "point",
    [
        "prune.clock:1",
        "prune.tombstone:1",
        "prune.tombstone:3",
        "prune.manifest:1",
        "prune.manifest:2",
        "prune.files:1",
    ],
)
def test_a_prune_killed_anywhere_leaves_the_prefix_valid_and_the_next_one_finishes(sink_dir, point):
    url = sink_dir.as_uri()
    r = run_cli(["prune", url, "--keep-last", "1"], env={"STAGERD_CRASH_AT": point})
    assert r.returncode == -9, r.stderr
    _valid(sink_dir)
    r = run_cli(["prune", url, "--keep-last", "1"])
    assert r.returncode == 0, r.stderr
    assert _steps(sink_dir) == [6] and _steps(sink_dir, "raw") == [6]
    _valid(sink_dir)
    assert not [p.name for p in sink_dir.iterdir() if "stagerd-clock" in p.name]  # the store's time, read


def test_prune_on_s3(tmp_path, s3):  # noqa: F811
    sink = FsspecSink.from_url(s3.url("run"))
    _publish(sink, tmp_path / "work", (1, 2, 3))
    sink.close()
    r = run_cli(["prune", s3.url("run"), "--keep-last", "1"])
    assert r.returncode == 0, r.stderr
    steps = {m.group(0) for k in s3.keys("run/") if (m := re.search(r"step-[0-9]+", k))}
    assert steps == {"step-00000003"}
    assert {k for k in s3.keys("run/raw/") if k.endswith(layout.MANIFEST_NAME)} == {
        "run/raw/step-00000003/" + layout.MANIFEST_NAME
    }


@pytest.mark.slow
def test_the_daemon_prunes_each_sink_after_each_publish(tmp_path, dcp_mixed2):
    from tests.daemon_helpers import fast_flags

    root, sink, other = tmp_path / "root", tmp_path / "sink", tmp_path / "other"
    for s in (1, 2, 3):
        step_dir = root / layout.step_dir_name(s)
        shutil.copytree(dcp_mixed2[0], step_dir / "model")
        commit_step(step_dir, 2)
    args = ["watch", root, "--sink", sink.as_uri(), "--sink", other.as_uri(), "--publish-raw", "--once"]
    # the sink named by another spelling of its place (a bare path, a trailing slash) is that sink
    args += ["--remote-keep-last", "1", "--sink-retention", f"{other}/=last=2", *fast_flags()]
    r = run_cli(args, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    assert _steps(sink) == [3] and _steps(sink, "raw") == [3]
    assert _steps(other) == [2, 3] and _steps(other, "raw") == [2, 3]  # its own numbers
    assert all(layout.is_committed(root / layout.step_dir_name(s)) for s in (1, 2, 3))  # local: separate
    _valid(sink)
    _valid(other)


@pytest.mark.parametrize(
    "flag", ["file:///x=last=0", "file:///x=keep=3", "file:///x", "hf://org/repo=last=2", "file:///y=last=2"]
)
def test_bad_sink_retention_is_a_config_error(tmp_path, flag):
    r = run_cli(["watch", tmp_path, "--sink", "file:///x", "--once", "--sink-retention", flag])
    assert r.returncode == 2 and "ConfigError" in r.stderr, r.stderr


def test_a_sink_retention_for_no_sink_never_shows_its_password(tmp_path):
    r = run_cli(
        ["watch", tmp_path, "--sink", "file:///x", "--once", "--sink-retention", "ftp://u:hunter2@h/d=last=2"]
    )
    assert r.returncode == 2 and "ConfigError" in r.stderr and "ftp://u:***@h/d" in r.stderr, r.stderr
    assert "hunter2" not in r.stderr + r.stdout


def test_node_locally_staged_raw_steps_are_pruned_whole_once_complete(tmp_path):
    sink_dir = tmp_path / "sink"
    sink = FsspecSink.from_url(sink_dir.as_uri())
    for s in (1, 2, 3):
        for node in range(2):
            if (s, node) == (1, 1):
                continue  # step 1: node 1's part never arrived, so step 1 is not complete
            d = tmp_path / f"n{node}" / layout.step_dir_name(s)
            (d / "model").mkdir(parents=True)
            (d / "model" / f"shard-{node}.safetensors").write_bytes(bytes([s, node]) * 100)
            commit_step(d, 2, staging_node=node, staging_nodes=2)
            sink.publish_raw(d, s)
    r = run_cli(["prune", sink_dir.as_uri(), "--keep-last", "1"])
    assert r.returncode == 0, r.stderr
    assert _steps(sink_dir, "raw") == [1, 3]  # 2 went whole; 1 is incomplete, kept
    assert not (sink_dir / "raw" / layout.step_dir_name(2)).exists()
    _valid(sink_dir)


@pytest.mark.slow
@pytest.mark.parametrize("point", ["prune.tombstone:1", "prune.manifest:2"])
def test_a_daemon_killed_inside_its_prune_leaves_the_sink_valid(tmp_path, dcp_mixed2, point):
    from tests.daemon_helpers import fast_flags

    root, sink = tmp_path / "root", tmp_path / "sink"
    for s in (1, 2, 3):
        step_dir = root / layout.step_dir_name(s)
        shutil.copytree(dcp_mixed2[0], step_dir / "model")
        commit_step(step_dir, 2)
    args = ["watch", root, "--sink", sink.as_uri(), "--publish-raw", "--once", "--remote-keep-last", "1"]
    r = run_cli([*args, *fast_flags()], env={"STAGERD_CRASH_AT": point}, timeout=180)
    assert r.returncode == -9, r.stderr[-2000:]
    _valid(sink)
    r = run_cli([*args, *fast_flags()], timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    assert _steps(sink) == [3] and _steps(sink, "raw") == [3]
    _valid(sink)
