"""A prefix shared with others: another publisher of the same step whose early keys the winner keeps,
and another tool's `latest` at the sink's root. Each test reproduces a red-team finding on the code
before the fix (RELIABILITY.md, "Data safety"); the stores are moto S3 through the fault proxy and real
directories.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from stagerd.contract import layout
from stagerd.sinks.fsspec import FsspecSink
from stagerd.sinks.prune import Policy, prune
from stagerd.sinks.remote import RemoteStore
from stagerd.sinks.s3.backend import S3Backend
from tests.s3server import s3, s3_server  # noqa: F401  (fixtures)
from tests.sinks.test_data_safety import MiB, _held_sink
from tests.sinks.test_sink_fsspec import make_export


class _ClaimsLate(S3Backend):
    """A publisher whose create-only PUTs land, and whose claim waits (on the event loop, without holding
    it) until released."""

    reached: threading.Event
    release: threading.Event

    async def _create(self, key: str, data: bytes) -> bool:
        if key.startswith("claims/"):
            import asyncio

            self.reached.set()
            await asyncio.to_thread(self.release.wait, 60)
        return await super()._create(key, data)


def test_a_losers_file_that_the_winner_kept_is_never_deleted_under_its_manifest(s3, tmp_path):  # noqa: F811
    """X's create-only PUT of `config.json` lands first, then Y claims step 7 and keeps that object (the
    same bytes as its own, so its PUT was refused and the checked path reused it). X then finds the step
    claimed: before the fix it deleted its `config.json` (the ETag still matched: the same bytes), and Y
    committed a manifest naming a file that was gone."""
    url = s3.url("race")
    sizes = {"model.safetensors": 5000, "config.json": 300}
    y_export = make_export(tmp_path / "y", sizes, seed=1)
    x_export = make_export(tmp_path / "x", sizes, seed=2)
    (x_export / "config.json").write_bytes((y_export / "config.json").read_bytes())
    real = FsspecSink.from_url(url, part_size=5 * MiB, max_concurrency=4)._backend
    assert isinstance(real, S3Backend)
    x_backend = _ClaimsLate(real.fs, real.bucket, real.root, real.part_size, real.max_concurrency)
    x_backend.reached, x_backend.release = threading.Event(), threading.Event()
    x_sink = FsspecSink(url, x_backend)
    y_sink, held = _held_sink(url, at_commit=True)
    outcome: dict[str, Any] = {}

    def run(name: str, sink: FsspecSink, export: Path) -> None:
        try:
            outcome[name] = sink.publish(export, 7)
        except Exception as e:  # reported below
            outcome[name] = e

    x = threading.Thread(target=run, args=("x", x_sink, x_export))
    x.start()
    try:
        assert x_backend.reached.wait(60)
        deadline = time.monotonic() + 10
        while "race/step-00000007/config.json" not in s3.keys("race/") and time.monotonic() < deadline:
            time.sleep(0.02)
        y = threading.Thread(target=run, args=("y", y_sink, y_export))
        y.start()
        assert held.opened.wait(60)  # Y verified its files and is about to commit
    finally:
        x_backend.release.set()
        x.join(60)
        held.release.set()
        y.join(60)
    assert type(outcome["x"]).__name__ == "StepClaimedError", outcome["x"]
    assert not isinstance(outcome["y"], Exception), outcome["y"]
    manifest = json.loads(s3.get(f"race/step-00000007/{layout.MANIFEST_NAME}"))
    for f in manifest["files"]:
        assert hashlib.sha256(s3.get(f"race/step-00000007/{f['path']}")).hexdigest() == f["sha256"], f


@pytest.mark.parametrize("store", ["s3", "file"])
def test_another_tools_latest_at_the_sink_root_is_never_overwritten(request, tmp_path, store, caplog):
    """A sink at a bucket's root (or a shared directory) that already holds another tool's `latest` (here
    a 3 MiB build artifact). stagerd's own `latest` always names a step (its writes are atomic), so one
    that names none is not stagerd's. Before the fix it was read whole and replaced by `step-00000001`."""
    foreign = b"build 2026-11-26\n" + bytes(range(256)) * (3 * 4096)
    if store == "s3":
        env = request.getfixturevalue("s3")
        env.client.put_object(Bucket=env.bucket, Key="latest", Body=foreign)
        url = f"s3://{env.bucket}"
        read = lambda: env.get("latest")  # noqa: E731
    else:
        (tmp_path / "sink").mkdir()
        (tmp_path / "sink" / "latest").write_bytes(foreign)
        url = (tmp_path / "sink").as_uri()
        read = (tmp_path / "sink" / "latest").read_bytes
    sink = FsspecSink.from_url(url)
    with caplog.at_level("WARNING"):
        assert not sink.publish(make_export(tmp_path / "e", {"m": 10}), 1).skipped
    assert read() == foreign
    assert "names no step" in caplog.text
    assert sink.is_published(1)


def test_two_trees_at_one_path_on_one_host_are_two_publishers(s3, tmp_path):  # noqa: F811
    """Two containers with host networking (one host name), each with its own ROOT mounted at one path,
    publish step 7 to one prefix. Before, the second took the first's claim (host and path) for its own
    restart: it swept the first's multipart uploads and wrote into a step the first was publishing. Now
    ROOT's device and inode are part of the claim: the second is told the step is claimed."""
    import shutil

    from stagerd.errors import StepClaimedError
    from stagerd.sinks.claims import claim_key, decode, owned_by, publish_claim

    sizes = {"model.safetensors": 5000, "config.json": 300}
    root = tmp_path / "ckpt"
    first = make_export(root / "step-00000007" / "export", sizes, seed=1)
    claim = publish_claim(first).encode()  # the first container, publishing (no manifest yet)
    s3.client.put_object(Bucket=s3.bucket, Key=f"run/{claim_key('step-00000007')}", Body=claim)
    assert owned_by(claim, publish_claim(first))  # its own restart still holds it
    old = json.loads(claim)
    del old["tree"]  # a claim an older stagerd wrote: host and path decide, as they did
    assert owned_by(json.dumps(old).encode(), publish_claim(first))

    root.rename(tmp_path / "first")  # kept: the second directory cannot reuse its inode
    second = make_export(root / "step-00000007" / "export", sizes, seed=2)
    assert decode(claim).owner == publish_claim(second).owner  # the same host and path
    with pytest.raises(StepClaimedError):
        FsspecSink.from_url(s3.url("run")).publish(second, 7)
    assert layout.MANIFEST_NAME not in str(s3.keys("run/"))
    shutil.rmtree(tmp_path / "first")


def test_a_recreated_export_outside_a_step_still_owns_its_claim(tmp_path):
    """`stagerd publish ./hf-7 --step 7` failed after its claim (no manifest yet); the user made ./hf-7
    again (the same files) and publishes again. Before the inode was in every claim, the rerun (same host
    and path) finished the step; with it, the new directory's inode took the rerun for another publisher:
    `StepClaimedError` for ever, for the path the claim itself names. Outside ROOT's layout only host and
    path decide, as they did."""
    import shutil

    from stagerd.sinks.claims import claim_key, publish_claim

    sizes = {"model.safetensors": 5000, "config.json": 300}
    export, sink = tmp_path / "hf-7", tmp_path / "sink"
    make_export(export, sizes, seed=1)
    claim = sink / claim_key("step-00000007")
    claim.parent.mkdir(parents=True)
    claim.write_bytes(publish_claim(export).encode())  # the first run's, left by its failure
    export.rename(tmp_path / "old")  # deleted once the new one is made: its inode is not reused
    make_export(export, sizes, seed=1)
    shutil.rmtree(tmp_path / "old")
    assert not FsspecSink.from_url(sink.as_uri()).publish(export, 7).skipped
    assert (sink / "step-00000007" / layout.MANIFEST_NAME).is_file()


def _stat_as(monkeypatch, path: Path, dev: int | None = None, ino: int | None = None) -> None:
    """Every `os.stat` of `path` answers device `dev` and inode `ino` (a reboot that renumbered the disk;
    another volume's root, inode 2 as every one's)."""
    import os

    real = os.stat

    def stat(p, *a, **kw):
        st = real(p, *a, **kw)
        if os.fspath(p) != str(path):
            return st
        fields = list(st[:10])
        fields[1], fields[2] = st.st_ino if ino is None else ino, st.st_dev if dev is None else dev
        return os.stat_result(fields)

    monkeypatch.setattr(os, "stat", stat)


def test_a_publishers_claim_is_still_its_own_after_a_reboot_renumbers_the_disk(tmp_path, monkeypatch):
    """A daemon's publish of step 7 was killed after its claim (no manifest yet); the machine rebooted and
    the kernel gave ROOT's disk another device number. The claim named ROOT's "device:inode", so the
    restarted daemon found its own claim foreign: `StepClaimedError` (retryable) on every retry, for ever.
    It names ROOT's identity now (`ROOT/.stagerd/fleet-root-id`), which a reboot keeps; a claim an older
    stagerd wrote keeps its meaning, and another ROOT at the same path, on another volume with the same
    device and inode numbers, is still another publisher."""
    import os
    import shutil

    from stagerd.errors import StepClaimedError
    from stagerd.sinks.claims import claim_key, owned_by, publish_claim

    sizes = {"model.safetensors": 5000, "config.json": 300}
    root, sink = tmp_path / "ckpt", tmp_path / "sink"
    (root / layout.STATE_DIR).mkdir(parents=True)  # a daemon's ROOT
    export = make_export(root / "step-00000007" / "export", sizes, seed=1)
    claim = sink / claim_key("step-00000007")
    claim.parent.mkdir(parents=True)
    claim.write_bytes(publish_claim(export).encode())  # the killed publish's
    st = os.stat(root)
    older = {"kind": "publish", "owner": json.loads(claim.read_bytes())["owner"], "host": "", "pid": 1}
    before = json.dumps({**older, "tree": f"{st.st_dev}:{st.st_ino}"}).encode()
    assert owned_by(before, publish_claim(export))  # an older stagerd's claim, no reboot: its own

    _stat_as(monkeypatch, root, dev=st.st_dev + 1)  # the reboot
    assert owned_by(claim.read_bytes(), publish_claim(export))
    assert not owned_by(before, publish_claim(export))  # an older stagerd's claim: as it always was
    assert not FsspecSink.from_url(sink.as_uri()).publish(export, 7).skipped
    assert (sink / "step-00000007" / layout.MANIFEST_NAME).is_file()

    root.rename(tmp_path / "first")  # another container's ROOT at the same path, on its own volume
    (root / layout.STATE_DIR).mkdir(parents=True)
    second = make_export(root / "step-00000007" / "export", sizes, seed=2)
    _stat_as(monkeypatch, root, dev=st.st_dev, ino=st.st_ino)  # both volumes' roots: the same numbers
    assert not owned_by(claim.read_bytes(), publish_claim(second))
    claim8 = sink / claim_key("step-00000008")
    claim8.write_bytes(claim.read_bytes())  # the first's claim of a step it is still publishing
    with pytest.raises(StepClaimedError):
        FsspecSink.from_url(sink.as_uri()).publish(second, 8)
    shutil.rmtree(tmp_path / "first")


def test_a_claim_naming_the_step_directorys_inode_is_still_its_publishers(tmp_path):
    """An older stagerd's publish of step 7 was killed after its claim (no manifest yet); that stagerd named
    the tree by the step directory's inode alone. Before, the upgraded daemon on the same host and tree
    found the claim foreign: `StepClaimedError` (retryable) on every retry, until someone deleted it. Now
    that inode is one of the tree's older names; another ROOT at the same path is still another publisher,
    and outside ROOT's layout host and path decide, as for this stagerd's own claims there."""
    import os
    import shutil

    from stagerd.errors import StepClaimedError
    from stagerd.sinks.claims import claim_key, owned_by, publish_claim

    sizes = {"model.safetensors": 5000, "config.json": 300}
    root, sink = tmp_path / "ckpt", tmp_path / "sink"
    (root / layout.STATE_DIR).mkdir(parents=True)  # a daemon's ROOT
    export = make_export(root / "step-00000007" / "export", sizes, seed=1)
    owner = json.loads(publish_claim(export).encode())["owner"]
    older = {"kind": "publish", "owner": owner, "host": "h", "pid": 1}
    claim = sink / claim_key("step-00000007")
    claim.parent.mkdir(parents=True)
    claim.write_text(json.dumps({**older, "tree": str(os.stat(export.parent).st_ino)}))
    eight = make_export(root / "step-00000008" / "export", sizes, seed=2)  # a step it still publishes
    claim8 = {**older, "owner": json.loads(publish_claim(eight).encode())["owner"]}
    (sink / claim_key("step-00000008")).write_text(
        json.dumps({**claim8, "tree": str(os.stat(eight.parent).st_ino)})
    )

    assert not FsspecSink.from_url(sink.as_uri()).publish(export, 7).skipped
    assert (sink / "step-00000007" / layout.MANIFEST_NAME).is_file()

    root.rename(tmp_path / "first")  # another container's ROOT at the same path: its own step directory
    (root / layout.STATE_DIR).mkdir(parents=True)
    second = make_export(root / "step-00000008" / "export", sizes, seed=2)
    assert publish_claim(second).owner == claim8["owner"]
    assert not owned_by((sink / claim_key("step-00000008")).read_bytes(), publish_claim(second))
    with pytest.raises(StepClaimedError):
        FsspecSink.from_url(sink.as_uri()).publish(second, 8)
    shutil.rmtree(tmp_path / "first")

    mine = tmp_path / "hf-5"  # `stagerd publish ./hf-5 --step 5`, killed; ./hf-5 made again since
    make_export(mine, sizes, seed=3)
    old = {**older, "owner": json.loads(publish_claim(mine).encode())["owner"], "tree": "1"}
    (sink / claim_key("step-00000005")).write_text(json.dumps(old))
    assert not FsspecSink.from_url(sink.as_uri()).publish(mine, 5).skipped


@pytest.mark.parametrize("store", ["s3", "s3-empty", "file-large", "file-dir", "file-link", "file-fifo"])
def test_retention_goes_on_beside_another_tools_latest(request, tmp_path, store, caplog):
    """`--remote-keep-last` at a sink that holds another tool's `latest`: a file over 1 KiB, an empty one
    (S3), a directory, or (a common convention) a link to the tool's newest checkpoint directory. Before the
    fix, prune raised `RestoreError` ("larger than 1024 bytes") or `SinkError` (`IsADirectoryError`; S3's
    416 to a ranged read of an empty object) on every run, so retention never deleted a step; on file://
    every publish failed after its manifest, for ever. A FIFO named `latest` held each publish for good."""
    foreign = b"" if store == "s3-empty" else b"build 2026-11-26\n" * 100
    sink_dir = tmp_path / "sink"
    sink_dir.mkdir()
    if store.startswith("s3"):
        env = request.getfixturevalue("s3")
        env.client.put_object(Bucket=env.bucket, Key="shared/latest", Body=foreign)
        url = f"s3://{env.bucket}/shared"
    else:
        url = sink_dir.as_uri()
        if store == "file-large":
            (sink_dir / "latest").write_bytes(foreign)
        elif store == "file-fifo":
            os.mkfifo(sink_dir / "latest")
        else:
            (sink_dir / "ckpt-9").mkdir()
            (sink_dir / "ckpt-9" / "model.bin").write_bytes(foreign)
            if store == "file-dir":
                (sink_dir / "latest").mkdir()
                (sink_dir / "latest" / "model.bin").write_bytes(foreign)
            else:
                (sink_dir / "latest").symlink_to("ckpt-9")
    sink = FsspecSink.from_url(url)
    try:
        for step in (1, 2):
            assert not sink.publish(make_export(tmp_path / f"e{step}", {"m": step}), step).skipped
    finally:
        sink.close()
    store_ = RemoteStore.open(url)
    try:
        fates = {d.step: d.delete for d in prune(store_, Policy(keep_last=1))}
        assert fates == {1: True, 2: False}
        assert [s for s in (1, 2) if store_.objects(layout.step_dir_name(s))] == [2]
    finally:
        store_.close()
    if store.startswith("s3"):
        assert env.get("shared/latest") == foreign
    elif store == "file-large":
        assert (sink_dir / "latest").read_bytes() == foreign
    elif store == "file-fifo":
        assert stat.S_ISFIFO(os.lstat(sink_dir / "latest").st_mode)
    else:
        assert (sink_dir / "latest" / "model.bin").read_bytes() == foreign
        assert (sink_dir / "latest").is_symlink() == (store == "file-link")
        assert (sink_dir / "ckpt-9" / "model.bin").read_bytes() == foreign
