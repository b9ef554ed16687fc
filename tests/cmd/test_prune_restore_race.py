"""`stagerd prune --keep-last 1` against a live `stagerd restore` of the step it would delete, on file://
and S3, of its HF export (`--export`) and of its raw step (into a ROOT): real processes, each held at a
delay point (`ops/crashpoints.py`) where the race is.

- A restore mid-read holds its lease: the prune leaves the step, the restore lands every byte, and a
  prune after it deletes the step.
- A restore that writes its lease after the prune listed `restoring/` (the prune held between its plan
  and its deletion): before the fix the prune deleted the step under the restore, which read the manifest
  before it wrote its lease; now the prune looks at the leases again once it holds the step's claims.
- A restore that starts once the prune holds the step's claims and has looked again: it stops before
  reading anything, `StepVanishedError` (retryable), and leaves nothing behind.
- A step deleted under a restore by something that honours no lease (an older stagerd's prune, a
  person): the restore fails with `StepVanishedError`, never a partial OUT."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from stagerd.contract import layout
from stagerd.sinks.fsspec import FsspecSink
from stagerd.sinks.leases import RESTORING_DIR
from stagerd.sinks.remote import RemoteStore
from tests.cli_helpers import run_cli, start_cli
from tests.cmd.restore_helpers import tree, wait_for_line
from tests.dcp_fixtures import commit_step
from tests.s3server import s3, s3_server  # noqa: F401  (fixtures)


def _export(d: Path, step: int) -> Path:
    d.mkdir(parents=True)
    (d / "model.safetensors").write_bytes(bytes(range(256)) * (12 << 10) + bytes([step]))  # 3 MiB
    (d / "config.json").write_text(f'{{"step": {step}}}')
    return d


def _raw(root: Path, step: int) -> Path:
    """A committed raw step (its shards' bytes only: a raw restore reads no tensor) of 3 MiB."""
    d = root / layout.step_dir_name(step)
    (d / "model").mkdir(parents=True)
    (d / "model" / "__0_0.distcp").write_bytes(bytes(range(256)) * (12 << 10) + bytes([step]))
    (d / "extras").mkdir()
    (d / "extras" / "loader.json").write_text(f'{{"pos": {step}}}')
    commit_step(d, 1)
    return d


@pytest.fixture(params=["export", "raw"])
def kind(request) -> str:
    """What the sink holds and the restore lands: HF exports (`--export`), or raw steps (into a ROOT)."""
    return request.param


@pytest.fixture(params=["file", "s3"])
def sink(request, kind, tmp_path, s3):  # noqa: F811
    """(URL, the store, the steps sent by number) of a sink holding steps 3 and 4 of `kind`."""
    url = (tmp_path / "sink").as_uri() if request.param == "file" else s3.url("run")
    sent = {}
    publisher = FsspecSink.from_url(url)
    for step in (3, 4):
        if kind == "export":
            sent[step] = _export(tmp_path / "exports" / str(step), step)
            publisher.publish(sent[step], step)
        else:
            sent[step] = _raw(tmp_path / "orig", step)
            publisher.publish_raw(sent[step], step)
    publisher.close()
    store = RemoteStore.open(url)
    yield url, store, sent
    store.close()


def _prefix(kind: str) -> str:
    return ("raw/" if kind == "raw" else "") + layout.step_dir_name(3)


def _restore(kind: str, url: str, tmp_path: Path, *more: str) -> tuple[list, Path]:
    """(the `stagerd restore` arguments of step 3 of `kind`, where it lands)."""
    if kind == "export":
        out = tmp_path / "outs" / "eval"
        return ["restore", url, out, "--export", "--step", "3", *more], out
    root = tmp_path / "root"
    return ["restore", url, root, "--step", "3", *more], root / layout.step_dir_name(3)


def _kept(store: RemoteStore, kind: str) -> bool:
    return store.read(f"{_prefix(kind)}/{layout.MANIFEST_NAME}") is not None


def _held(args: list[str], point: str, release: Path) -> subprocess.Popen[str]:
    return start_cli(args, env={"STAGERD_DELAY_AT": f"{point}:120", "STAGERD_DELAY_RELEASE": str(release)})


def _finish(proc: subprocess.Popen[str], release: Path) -> tuple[int, str, str]:
    release.touch()
    out, err = proc.communicate(timeout=120)
    return proc.returncode, out, err


def _pruned_after(url: str, store: RemoteStore, kind: str) -> None:
    """A prune once no restore runs deletes step 3, and no lease is left."""
    r = run_cli(["prune", url, "--keep-last", "1"])
    assert r.returncode == 0, r.stderr
    assert not _kept(store, kind), r.stdout
    assert store.objects(RESTORING_DIR) == {}


def _nothing_landed(out: Path) -> None:
    """No OUT (a raw step's: no step directory in ROOT) and no temp directory left beside it."""
    assert not out.exists()
    left = [] if not out.parent.exists() else [p.name for p in out.parent.iterdir()]
    assert [n for n in left if n != layout.STATE_DIR] == [], left
    state = out.parent / layout.STATE_DIR
    assert not state.exists() or {p.name for p in state.iterdir()} <= {"lock"}, list(state.iterdir())


def test_a_prune_leaves_the_step_a_restore_is_reading(sink, kind, tmp_path):
    url, store, sent = sink
    go_on = tmp_path / "go-on"
    args, out = _restore(kind, url, tmp_path)
    restore = _held(args, "restore.piece", go_on)
    try:
        wait_for_line(restore, "delay point restore.piece")
        r = run_cli(["prune", url, "--keep-last", "1"])
        assert r.returncode == 0, r.stderr
        assert "a restore is reading it" in r.stdout, r.stdout
        assert _kept(store, kind)
    finally:
        rc, _, err = _finish(restore, go_on)
    assert rc == 0, err
    assert tree(out) == tree(sent[3])
    _pruned_after(url, store, kind)


def test_a_lease_written_after_the_prune_listed_the_leases_keeps_the_step(sink, kind, tmp_path):
    url, store, sent = sink
    prune_on, restore_on = tmp_path / "prune-on", tmp_path / "restore-on"
    args, out = _restore(kind, url, tmp_path)
    prune = _held(["prune", url, "--keep-last", "1"], "prune.decided", prune_on)
    restore = None
    try:
        wait_for_line(prune, "delay point prune.decided")  # leases listed, step 3 to go
        restore = _held(args, "restore.piece", restore_on)
        wait_for_line(restore, "delay point restore.piece")  # its lease written, the step half read
        rc, stdout, err = _finish(prune, prune_on)
        assert rc == 0, err
        assert _kept(store, kind), f"the prune deleted the step a restore reads: {stdout}"
        assert "a restore is reading it" in stdout, stdout
    finally:
        if prune.poll() is None:
            _finish(prune, prune_on)
        if restore is not None:
            rc, _, err = _finish(restore, restore_on)
    assert rc == 0, err
    assert tree(out) == tree(sent[3])
    _pruned_after(url, store, kind)


def test_a_restore_that_starts_while_a_prune_deletes_the_step_stops_before_reading(sink, kind, tmp_path):
    url, store, _ = sink
    go_on = tmp_path / "go-on"
    args, out = _restore(kind, url, tmp_path)
    prune = _held(["prune", url, "--keep-last", "1"], "prune.tombstone", go_on)
    try:
        wait_for_line(prune, "delay point prune.tombstone")  # step 3's claims taken, leases looked at again
        r = run_cli(args)
        assert r.returncode == 3, r.stderr  # retryable
        assert "StepVanishedError" in r.stderr and "being deleted by a prune" in r.stderr, r.stderr
        _nothing_landed(out)
    finally:
        rc, stdout, err = _finish(prune, go_on)
    assert rc == 0, err
    assert not _kept(store, kind), stdout
    assert store.objects(RESTORING_DIR) == {}


def test_a_step_deleted_under_a_restore_by_what_honours_no_lease_fails_it_cleanly(sink, kind, tmp_path):
    url, store, _ = sink
    go_on = tmp_path / "go-on"
    # one file at a time: the other files are read only after the deletion
    args, out = _restore(kind, url, tmp_path, "--workers", "1")
    restore = _held(args, "restore.piece", go_on)
    try:
        wait_for_line(restore, "delay point restore.piece")
        step = _prefix(kind)
        store.delete([f"{step}/{rel}" for rel in store.objects(step)])  # as an older stagerd's prune does
    finally:
        rc, _, err = _finish(restore, go_on)
    assert rc == 3, err
    assert "StepVanishedError" in err and "disappeared from the sink during the restore" in err, err
    _nothing_landed(out)
