"""`stagerd restore` (issue 13): a raw step from a file:// or S3 sink back into ROOT, checked, marker last.

The raw steps are published in process with `FsspecSink.publish_raw`; every restore is a real
`stagerd restore` child. Refusals land nothing; a SIGKILL at each restore crash point, then a second run,
lands the step once; a restored step is never published again by a daemon.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from stagerd.contract import commit_marker, layout
from stagerd.daemon.journal import Journal
from stagerd.daemon.lock import RootLock
from stagerd.sinks.fsspec import FsspecSink
from tests.cli_helpers import STAGERD, clean_env, run_cli
from tests.cmd.restore_helpers import raw_step, run_restore, tree, wait_for_line
from tests.daemon_helpers import fast_flags
from tests.dcp_fixtures import commit_step
from tests.s3server import s3, s3_server  # noqa: F401  (fixtures)


@pytest.fixture
def published(tmp_path, dcp_mixed2) -> tuple[Path, Path]:
    """(the original ROOT with steps 1, 2, 3, a file:// sink holding their raw steps)."""
    root, sink_dir = tmp_path / "orig", tmp_path / "sink"
    sink = FsspecSink.from_url(sink_dir.as_uri())
    for s in (1, 2, 3):
        sink.publish_raw(raw_step(root, s, dcp_mixed2[0]), s)
    return root, sink_dir


def _same_step(a: Path, b: Path) -> None:
    skip = {layout.EXPORT_OPTIONS_NAME}
    assert {k: v for k, v in tree(a).items() if k not in skip} == tree(b)


def test_restores_latest_and_a_middle_step_and_the_daemon_never_republishes_them(published, tmp_path):
    orig, sink = published
    new = tmp_path / "new"
    r = run_restore(sink.as_uri(), new)
    assert r.returncode == 0, r.stderr
    assert "restore step 3" in r.stderr  # progress
    r = run_restore(sink.as_uri(), new, "--step", "2")
    assert r.returncode == 0, r.stderr
    for s in (2, 3):
        _same_step(orig / layout.step_dir_name(s), new / layout.step_dir_name(s))
    assert not (new / layout.step_dir_name(1)).exists()
    assert not (new / layout.STATE_DIR / "restore").exists()
    j = Journal.open_readonly(new)
    try:
        assert {r.step: r.state for r in j.steps()} == {2: "retired", 3: "retired"}
        assert all("restored by `stagerd restore`" in (e.message or "") for e in j.events())
    finally:
        j.close()
    out = tmp_path / "out"
    r = run_cli(["watch", new, "--sink", out.as_uri(), "--publish-raw", "--once", *fast_flags()], timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "--once: 0 step(s) published, 0 not" in r.stdout, r.stdout  # the run published nothing
    assert "2 step(s) restored by `stagerd restore` (2, 3): not published again" in r.stdout, r.stdout
    assert not out.exists() or not any(out.rglob("*.json"))  # nothing published again
    assert not (new / layout.step_dir_name(3) / layout.EXPORT_DIR).exists()
    j = Journal.open_readonly(new)
    try:
        assert j.lanes() == [] and {r.step: r.state for r in j.steps()} == {2: "retired", 3: "retired"}
    finally:
        j.close()
    r = run_cli(["status", new], env={"COLUMNS": "80"})  # only retired steps: no table of headers alone
    assert r.returncode == 0 and "state" not in r.stdout, r.stdout
    assert "2 retired (`stagerd status --all` lists retired steps)" in r.stdout, r.stdout


def test_refuses_a_committed_step_and_a_root_a_daemon_holds(published, tmp_path):
    _, sink = published
    new = tmp_path / "new"
    assert run_restore(sink.as_uri(), new, "--step", "1").returncode == 0
    before = tree(new / layout.step_dir_name(1))
    r = run_restore(sink.as_uri(), new, "--step", "1")
    assert r.returncode == 2 and "StepExistsError" in r.stderr and "already committed" in r.stderr
    assert "Stager.load(..., step=1)" in r.stderr and "use a new step number" not in r.stderr, r.stderr
    assert tree(new / layout.step_dir_name(1)) == before
    with RootLock(new):
        r = run_restore(sink.as_uri(), new, "--step", "2")
    assert r.returncode == 2 and "LockError" in r.stderr
    assert "stop that `stagerd watch`, run the restore" in r.stderr and "point this one" not in r.stderr
    assert not (new / layout.step_dir_name(2)).exists()
    r = run_restore(sink.as_uri(), new, "--step", "9")  # not there: the steps that are, newest first
    flat = " ".join(r.stderr.split())
    assert r.returncode == 2 and "the sink holds 3 raw step(s): 3, 2, 1 (newest first)" in flat, r.stderr
    assert not (new / layout.step_dir_name(9)).exists()


def _damage_cases(sink: Path) -> list[tuple[str, callable]]:
    raw = sink / "raw" / layout.step_dir_name(3)
    shard = sorted((raw / "model").glob("*.safetensors"))[0]

    def flip() -> None:
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))

    def truncate_manifest() -> None:
        m = raw / layout.MANIFEST_NAME
        m.write_bytes(m.read_bytes()[:-40])

    return [
        (f"model/{shard.name}: sha256", flip),
        ("optim/__0_0.distcp: is listed in the manifest but missing", (raw / "optim/__0_0.distcp").unlink),
        (f"{layout.MANIFEST_NAME}: remote manifest is not valid JSON", truncate_manifest),
    ]


@pytest.mark.parametrize("case", [0, 1, 2], ids=["corrupt-shard", "missing-shard", "truncated-manifest"])
def test_a_corrupt_or_missing_remote_object_is_named_and_nothing_lands(published, tmp_path, case):
    _, sink = published
    text, damage = _damage_cases(sink)[case]
    damage()
    new = tmp_path / "new"
    r = run_restore(sink.as_uri(), new, "--step", "3")
    assert r.returncode == 2, r.stderr
    assert "RestoreError" in r.stderr and text in r.stderr, r.stderr
    assert not (new / layout.step_dir_name(3)).exists()
    assert not (new / layout.STATE_DIR / "restore").exists()


@pytest.mark.parametrize(
    "point", ["restore.piece:1", "restore.piece:4", "restore.landed", "restore.journaled"]
)
def test_a_restore_killed_anywhere_lands_the_step_once_when_run_again(published, tmp_path, point):
    orig, sink = published
    new = tmp_path / "new"
    r = run_restore(sink.as_uri(), new, "--step", "2", "--workers", "2", env={"STAGERD_CRASH_AT": point})
    assert r.returncode == -9, r.stderr
    assert not layout.is_committed(new / layout.step_dir_name(2))  # nothing that looks committed
    r = run_restore(sink.as_uri(), new, "--step", "2")
    assert r.returncode == 0, r.stderr
    _same_step(orig / layout.step_dir_name(2), new / layout.step_dir_name(2))
    assert not (new / layout.STATE_DIR / "restore").exists()
    j = Journal.open_readonly(new)
    try:
        assert {r.step: r.state for r in j.steps()} == {2: "retired"}
    finally:
        j.close()


def test_restores_from_s3_and_refuses_a_corrupt_object(tmp_path, dcp_mixed2, s3):  # noqa: F811
    root = tmp_path / "orig"
    sink = FsspecSink.from_url(s3.url("run"))
    for s in (1, 2):
        sink.publish_raw(raw_step(root, s, dcp_mixed2[0]), s)
    sink.close()
    new = tmp_path / "new"
    r = run_restore(s3.url("run"), new, "--step", "1")
    assert r.returncode == 0, r.stderr
    _same_step(root / layout.step_dir_name(1), new / layout.step_dir_name(1))
    key = f"run/raw/{layout.step_dir_name(2)}/optim/__0_0.distcp"
    data = bytearray(s3.get(key))
    data[0] ^= 1
    s3.client.put_object(Bucket=s3.bucket, Key=key, Body=bytes(data))
    r = run_restore(s3.url("run"), new)  # latest: step 2
    assert r.returncode == 2 and "RestoreError" in r.stderr and "optim/__0_0.distcp" in r.stderr, r.stderr
    assert not (new / layout.step_dir_name(2)).exists()


def test_a_node_locally_staged_step_comes_back_whole(tmp_path, dcp_mixed2):
    from stagerd.engine.export import export_step

    sink_dir = tmp_path / "sink"
    sink = FsspecSink.from_url(sink_dir.as_uri())
    shards = sorted(dcp_mixed2[0].glob("*.safetensors"))
    for node, shard in enumerate(shards):  # each node staged its rank's shard; node 0 the optimizer too
        step_dir = tmp_path / f"node{node}" / layout.step_dir_name(4)
        (step_dir / "model").mkdir(parents=True)
        shutil.copy(shard, step_dir / "model" / shard.name)
        if node == 0:
            (step_dir / "optim").mkdir()
            (step_dir / "optim" / ".metadata").write_bytes(b"m" * 10)
        commit_step(step_dir, 2, staging_node=node, staging_nodes=2)
        sink.publish_raw(step_dir, 4)
    assert (
        sink_dir / "raw" / layout.step_dir_name(4) / "node-00001-of-00002" / layout.MANIFEST_NAME
    ).exists()
    new = tmp_path / "new"
    r = run_restore(sink_dir.as_uri(), new, "--step", "4")
    assert r.returncode == 0, r.stderr
    step_dir = new / layout.step_dir_name(4)
    marker = commit_marker.read_marker(step_dir)
    assert (marker.staging_node, marker.staging_nodes) == (0, 1)
    assert sorted(f.path for f in marker.files) == sorted(
        [f"model/{s.name}" for s in shards] + ["optim/.metadata"]
    )
    commit_marker.check_staged_files(step_dir, marker)
    assert export_step(step_dir).files  # the whole model: it exports
    shutil.rmtree(sink_dir / "raw" / layout.step_dir_name(4) / "node-00001-of-00002")
    r = run_restore(sink_dir.as_uri(), tmp_path / "other", "--step", "4")
    assert r.returncode == 2 and "not every staging node's" in r.stderr, r.stderr


def test_a_symlink_anywhere_in_the_target_is_refused_and_nothing_changes(published, tmp_path):
    """`ROOT/step-N` a link to another directory (before: a raw `OSError` traceback), ROOT itself a link,
    and an `--export` OUT under a linked directory: each a `SymlinkError`, exit 2, the link and what it
    points at untouched."""
    _, sink = published
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep.txt").write_text("not yours")
    root = tmp_path / "root"
    root.mkdir()
    (root / layout.step_dir_name(2)).symlink_to(elsewhere, target_is_directory=True)
    (tmp_path / "linked-root").symlink_to(tmp_path / "other-root")
    (tmp_path / "other-root").mkdir()
    cases = [
        (root, ["--step", "2"]),
        (tmp_path / "linked-root", ["--step", "2"]),
        (tmp_path / "linked-root" / "eval", ["--export", "--step", "2"]),
    ]
    for target, args in cases:
        r = run_restore(sink.as_uri(), target, *args)
        assert r.returncode == 2 and "SymlinkError" in r.stderr and "symbolic link" in r.stderr, r.stderr
        assert "Traceback" not in r.stderr
    assert (root / layout.step_dir_name(2)).is_symlink() and tree(elsewhere) == {"keep.txt": b"not yours"}
    assert not any((tmp_path / "other-root").iterdir())


_SAVE = """
import sys, torch
from stagerd import Stager
s = Stager(sys.argv[1])
s.save({"w": torch.full((4, 4), 7.0)}, int(sys.argv[2])).result()
s.close()
"""


def test_a_stager_save_and_a_restore_of_one_step_exclude_each_other(published, tmp_path):
    """A restore that holds step 2 (downloaded, about to land) refuses a Stager save of step 2, which then
    lands intact; a Stager save that holds step 3 (written, marker not yet) refuses a restore of step 3,
    which then commits as saved. Before, either one deleted or mixed into the other's step directory."""
    from stagerd import Stager
    from stagerd.errors import SaveError

    orig, sink = published
    root = tmp_path / "root"
    go_on = tmp_path / "go-on"  # each paused child goes on once this exists
    env = clean_env({"STAGERD_DELAY_AT": "restore.landing:60", "STAGERD_DELAY_RELEASE": str(go_on)})
    args = [*STAGERD, "restore", sink.as_uri(), str(root), "--step", "2"]
    restore = subprocess.Popen(args, env=env, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_line(restore, "delay point restore.landing")
        stager = Stager(root)
        with pytest.raises(SaveError, match=r"StepBusyError: .* being written by a restore"):
            stager.save({"w": torch.ones(4, 4)}, 2).result()
        with contextlib.suppress(SaveError):  # close() reports the failed save once more
            stager.close()
    finally:
        go_on.touch()
        assert restore.wait(60) == 0, restore.stderr.read()
    go_on.unlink()
    _same_step(orig / layout.step_dir_name(2), root / layout.step_dir_name(2))

    env = clean_env({"STAGERD_DELAY_AT": "save.marker:60", "STAGERD_DELAY_RELEASE": str(go_on)})
    save = subprocess.Popen(
        [sys.executable, "-c", _SAVE, str(root), "3"], env=env, stderr=subprocess.PIPE, text=True
    )
    try:
        wait_for_line(save, "delay point save.marker")
        r = run_restore(sink.as_uri(), root, "--step", "3")
        assert r.returncode == 3 and "StepBusyError" in r.stderr and "Stager save" in r.stderr, r.stderr
    finally:
        go_on.touch()
        assert save.wait(120) == 0, save.stderr.read()
    marker = commit_marker.read_marker(root / layout.step_dir_name(3))
    assert marker.world_size == 1  # the save's own step (the published one was saved by 2 ranks)
    commit_marker.check_staged_files(root / layout.step_dir_name(3), marker)


def test_a_file_where_the_target_directory_must_be_is_a_config_error(tmp_path, capsys):
    """Before the fix: raw `FileExistsError` (ROOT a file) and `NotADirectoryError` (OUT below a file)
    tracebacks, exit 1."""
    from stagerd.cli import main

    export = tmp_path / "export"
    export.mkdir()
    (export / "config.json").write_text("{}")
    FsspecSink.from_url((tmp_path / "sink").as_uri()).publish(export, 3)
    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine")
    for target, flags in ((a_file, []), (a_file / "eval", ["--export"])):
        assert main(["restore", (tmp_path / "sink").as_uri(), str(target), *flags]) == 2
        assert "ConfigError" in capsys.readouterr().err
    assert a_file.read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export", "notes.txt", "sink"]


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("file://rawsink", "names a host or relative path after file://"),
        ("s3://", "names no bucket"),
        ("memory://x", "is not a durable store"),
        ("file:///p%20x", "has %-escapes"),
        ("S3://b/p", "has an upper-case scheme"),
    ],
)
def test_restore_checks_its_url_as_publish_and_prune_do(tmp_path, monkeypatch, capsys, url, why):
    """Before the fix, restore read these loosely: a relative file:// path under the working directory,
    `s3:/raw/latest` "is missing", an empty memory:// store, a directory named `p%20x`, "Protocol not
    known: S3"."""
    from stagerd.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["restore", url, str(tmp_path / "n")]) == 2
    err = capsys.readouterr().err
    assert "ConfigError: sink URL" in err and why in err, err
    assert list(tmp_path.iterdir()) == []
