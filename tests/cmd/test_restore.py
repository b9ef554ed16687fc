"""`stagerd restore` (issue 13): a raw step from a file:// or S3 sink back into ROOT, checked, marker last.

The raw steps are published in process with `FsspecSink.publish_raw`; every restore is a real
`stagerd restore` child. Refusals land nothing; a SIGKILL at each restore crash point, then a second run,
lands the step once; a restored step is never published again by a daemon.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from stagerd.contract import layout
from stagerd.daemon.journal import Journal
from stagerd.daemon.lock import RootLock
from stagerd.sinks.fsspec import FsspecSink
from tests.cli_helpers import STAGERD, clean_env, run_cli
from tests.daemon_helpers import fast_flags
from tests.dcp_fixtures import commit_step
from tests.s3server import s3, s3_server  # noqa: F401  (fixtures)


def _step(root: Path, s: int, model_src: Path) -> Path:
    step_dir = root / layout.step_dir_name(s)
    (step_dir / "optim").mkdir(parents=True)
    (step_dir / "optim" / "__0_0.distcp").write_bytes(bytes(range(256)) * (100 + s))
    (step_dir / "extras").mkdir()
    (step_dir / "extras" / "loader.json").write_text(json.dumps({"pos": s}))
    shutil.copytree(model_src, step_dir / "model")
    commit_step(step_dir, 2)
    return step_dir


@pytest.fixture
def published(tmp_path, dcp_mixed2) -> tuple[Path, Path]:
    """(the original ROOT with steps 1, 2, 3, a file:// sink holding their raw steps)."""
    root, sink_dir = tmp_path / "orig", tmp_path / "sink"
    sink = FsspecSink.from_url(sink_dir.as_uri())
    for s in (1, 2, 3):
        sink.publish_raw(_step(root, s, dcp_mixed2[0]), s)
    return root, sink_dir


def _tree(d: Path) -> dict[str, bytes]:
    return {p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def _same_step(a: Path, b: Path) -> None:
    skip = {layout.EXPORT_OPTIONS_NAME}
    assert {k: v for k, v in _tree(a).items() if k not in skip} == _tree(b)


def _restore(url: str, root: Path, *args: str, env: dict | None = None):
    return run_cli(["restore", url, root, *args], env=env, timeout=120)


def test_restores_latest_and_a_middle_step_and_the_daemon_never_republishes_them(published, tmp_path):
    orig, sink = published
    new = tmp_path / "new"
    r = _restore(sink.as_uri(), new)
    assert r.returncode == 0, r.stderr
    assert "restore step 3" in r.stderr  # progress
    r = _restore(sink.as_uri(), new, "--step", "2")
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
    assert not out.exists() or not any(out.rglob("*.json"))  # nothing published again
    assert not (new / layout.step_dir_name(3) / layout.EXPORT_DIR).exists()
    j = Journal.open_readonly(new)
    try:
        assert j.lanes() == [] and {r.step: r.state for r in j.steps()} == {2: "retired", 3: "retired"}
    finally:
        j.close()


def test_refuses_a_committed_step_and_a_root_a_daemon_holds(published, tmp_path):
    _, sink = published
    new = tmp_path / "new"
    assert _restore(sink.as_uri(), new, "--step", "1").returncode == 0
    before = _tree(new / layout.step_dir_name(1))
    r = _restore(sink.as_uri(), new, "--step", "1")
    assert r.returncode == 2 and "StepExistsError" in r.stderr and "already committed" in r.stderr
    assert _tree(new / layout.step_dir_name(1)) == before
    with RootLock(new):
        r = _restore(sink.as_uri(), new, "--step", "2")
    assert r.returncode == 2 and "LockError" in r.stderr
    assert not (new / layout.step_dir_name(2)).exists()


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
    r = _restore(sink.as_uri(), new, "--step", "3")
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
    r = _restore(sink.as_uri(), new, "--step", "2", "--workers", "2", env={"STAGERD_CRASH_AT": point})
    assert r.returncode == -9, r.stderr
    assert not layout.is_committed(new / layout.step_dir_name(2))  # nothing that looks committed
    r = _restore(sink.as_uri(), new, "--step", "2")
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
        sink.publish_raw(_step(root, s, dcp_mixed2[0]), s)
    sink.close()
    new = tmp_path / "new"
    r = _restore(s3.url("run"), new, "--step", "1")
    assert r.returncode == 0, r.stderr
    _same_step(root / layout.step_dir_name(1), new / layout.step_dir_name(1))
    key = f"run/raw/{layout.step_dir_name(2)}/optim/__0_0.distcp"
    data = bytearray(s3.get(key))
    data[0] ^= 1
    s3.client.put_object(Bucket=s3.bucket, Key=key, Body=bytes(data))
    r = _restore(s3.url("run"), new)  # latest: step 2
    assert r.returncode == 2 and "RestoreError" in r.stderr and "optim/__0_0.distcp" in r.stderr, r.stderr
    assert not (new / layout.step_dir_name(2)).exists()


def test_restores_a_published_hf_export_into_a_plain_directory(tmp_path, dcp_mixed2):
    from stagerd.engine.export import export_step

    step_dir = _step(tmp_path / "orig", 5, dcp_mixed2[0])
    export_step(step_dir)
    sink_dir = tmp_path / "sink"
    FsspecSink.from_url(sink_dir.as_uri()).publish(step_dir / layout.EXPORT_DIR, 5)
    out = tmp_path / "eval-5"
    r = _restore(sink_dir.as_uri(), out, "--export")
    assert r.returncode == 0, r.stderr
    assert _tree(out) == _tree(step_dir / layout.EXPORT_DIR)
    r = run_cli(["verify", out])
    assert r.returncode == 0, r.stderr
    r = _restore(sink_dir.as_uri(), out, "--export")
    assert r.returncode == 2 and "not an empty directory" in r.stderr


def test_restores_an_hf_export_from_the_hub_checked_against_its_tree(tmp_path):
    from tests.hubserver import HubConfig, HubServer
    from tests.sinks.hub.hub_helpers import REPO, export_files, make_sink, write_export

    with HubServer(config=HubConfig()) as hub:
        export = write_export(tmp_path / "export")
        make_sink(hub).publish(export, 7)
        url = f"hf://{REPO}?endpoint={hub.endpoint}"
        env = {"HF_TOKEN": hub.token, "HF_HUB_DISABLE_XET": None}  # Xet
        r = _restore(url, tmp_path / "eval-7", "--export", "--step", "7", env=env)
        assert r.returncode == 0, r.stderr
        got = _tree(tmp_path / "eval-7")
        assert {k: v for k, v in got.items() if k != "README.md"} == export_files(export)  # + the card
        r = _restore(url, tmp_path / "raw", "--step", "7", env=env)
        assert r.returncode == 2 and "--export" in r.stderr
        big = max(export.glob("*.safetensors"), key=lambda p: p.stat().st_size)
        hub.tamper(hashlib.sha256(big.read_bytes()).hexdigest(), at=100)
        r = _restore(url, tmp_path / "bad", "--export", env=env)
        assert r.returncode == 2 and "RestoreError" in r.stderr and big.name in r.stderr, r.stderr
        assert not (tmp_path / "bad").exists() and not list(tmp_path.glob(".bad.restore-*"))


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
    r = _restore(sink_dir.as_uri(), new, "--step", "4")
    assert r.returncode == 0, r.stderr
    step_dir = new / layout.step_dir_name(4)
    marker = layout.read_marker(step_dir)
    assert (marker.staging_node, marker.staging_nodes) == (0, 1)
    assert sorted(f.path for f in marker.files) == sorted(
        [f"model/{s.name}" for s in shards] + ["optim/.metadata"]
    )
    layout.check_staged_files(step_dir, marker)
    assert export_step(step_dir).files  # the whole model: it exports
    shutil.rmtree(sink_dir / "raw" / layout.step_dir_name(4) / "node-00001-of-00002")
    r = _restore(sink_dir.as_uri(), tmp_path / "other", "--step", "4")
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
        r = _restore(sink.as_uri(), target, *args)
        assert r.returncode == 2 and "SymlinkError" in r.stderr and "symbolic link" in r.stderr, r.stderr
        assert "Traceback" not in r.stderr
    assert (root / layout.step_dir_name(2)).is_symlink() and _tree(elsewhere) == {"keep.txt": b"not yours"}
    assert not any((tmp_path / "other-root").iterdir())


def _wait_for(proc: subprocess.Popen, text: str, seconds: float = 60) -> str:
    """The child's stderr up to the line holding `text` (it is then paused at a delay point)."""
    seen = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        seen.append(line)
        if text in line:
            return "".join(seen)
        if not line and proc.poll() is not None:
            break
    raise AssertionError(f"{text!r} never came: {''.join(seen)[-2000:]}")


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
        _wait_for(restore, "delay point restore.landing")
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
        _wait_for(save, "delay point save.marker")
        r = _restore(sink.as_uri(), root, "--step", "3")
        assert r.returncode == 3 and "StepBusyError" in r.stderr and "Stager save" in r.stderr, r.stderr
    finally:
        go_on.touch()
        assert save.wait(120) == 0, save.stderr.read()
    marker = layout.read_marker(root / layout.step_dir_name(3))
    assert marker.world_size == 1  # the save's own step (the published one was saved by 2 ranks)
    layout.check_staged_files(root / layout.step_dir_name(3), marker)


def _cut_bodies(monkeypatch, key_part: str, times: int, between=lambda: None) -> list[str]:
    """The test proxy sends the first `times` GETs of a key containing `key_part` only half their body,
    then drops the connection (`between` runs before each cut); the ranges asked for are returned."""
    from tests.s3server import FaultProxy

    forward, ranges = FaultProxy.__call__, []

    def call(self, environ, start_response):
        out = forward(self, environ, start_response)
        if environ["REQUEST_METHOD"] != "GET" or key_part not in environ.get("RAW_URI", ""):
            return out
        ranges.append(environ.get("HTTP_RANGE", ""))
        if len(ranges) > times:
            return out
        data = b"".join(out)
        between()

        def half():
            yield data[: len(data) // 2]
            raise ConnectionResetError("cut by the test")

        return half()

    monkeypatch.setattr(FaultProxy, "__call__", call)
    return ranges


@pytest.mark.parametrize("case", ["resumed", "cut-for-good", "replaced"])
def test_an_s3_download_cut_midway_goes_on_or_is_a_named_error(tmp_path, s3, monkeypatch, case):  # noqa: F811
    """A connection reset after an S3 GET's answer began (botocore retries only until then). Before the
    fix, a raw `aiohttp.ClientPayloadError` ended the restore (a traceback, exit 1) at the first cut."""
    from stagerd.cmd.restore import restore_export
    from stagerd.errors import RestoreError, SinkError
    from stagerd.sinks import fetch
    from stagerd.sinks.remote import RemoteStore

    export = tmp_path / "export"
    export.mkdir()
    (export / "model.safetensors").write_bytes(bytes(range(256)) * (4 << 10))  # 1 MiB
    (export / "config.json").write_text("{}")
    sink = FsspecSink.from_url(s3.url("run"))
    sink.publish(export, 4)
    sink.close()
    key = f"run/{layout.step_dir_name(4)}/model.safetensors"
    other = lambda: s3.client.put_object(Bucket=s3.bucket, Key=key, Body=b"x" * (1 << 20))  # noqa: E731
    times = {"resumed": 2, "cut-for-good": 9, "replaced": 1}[case]
    ranges = _cut_bodies(
        monkeypatch, "model.safetensors", times, other if case == "replaced" else lambda: None
    )
    monkeypatch.setattr(fetch, "STREAM_RETRIES", 2)
    monkeypatch.setattr(fetch, "STREAM_BACKOFF_S", 0.0)
    out = tmp_path / "eval"
    store = RemoteStore.open(s3.url("run"))
    try:
        if case == "resumed":
            restore_export(store, out, 4)
            assert _tree(out) == _tree(export)
            # each GET goes on from the byte the last one reached: at most the half the proxy sent (a
            # cut can land before the client has read all of it)
            first, second = (int(r.removeprefix("bytes=").removesuffix("-")) for r in ranges[1:])
            assert ranges[0] == "" and len(ranges) == 3, ranges
            assert 0 < first <= (1 << 19) and first < second <= first + ((1 << 20) - first) // 2, ranges
            return
        error = SinkError if case == "cut-for-good" else RestoreError
        with pytest.raises(error, match=r"cut 3 time|changed on the sink") as e:
            restore_export(store, out, 4)
    finally:
        store.close()
    assert e.value.retryable == (case == "cut-for-good") and key in str(e.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]  # nothing landed, no temp left


@pytest.mark.parametrize("out", [".", "./"])
def test_an_export_restores_into_the_empty_directory_one_is_in(tmp_path, monkeypatch, capsys, out):
    """`mkdir eval && cd eval && stagerd restore URL . --export`. Before the fix: a raw `ValueError:
    PosixPath('.') has an empty name` traceback (exit 1), for file://, S3 and the Hub alike."""
    from stagerd.cli import main

    export, here = tmp_path / "export", tmp_path / "eval"
    export.mkdir()
    (export / "config.json").write_text("{}")
    FsspecSink.from_url((tmp_path / "sink").as_uri()).publish(export, 3)
    here.mkdir()
    monkeypatch.chdir(here)
    assert main(["restore", (tmp_path / "sink").as_uri(), out, "--export"]) == 0
    assert f"restored {here}" in capsys.readouterr().out
    assert _tree(here) == _tree(export)


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
