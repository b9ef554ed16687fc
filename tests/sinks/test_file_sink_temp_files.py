"""A file:// sink's temp files on a directory several hosts share (NFS): the sweep removes only this host's
killed writers' temp files, and another host's, or an older stagerd's, only once nobody has written them for
`TEMP_STALE_S` by the store's clock."""

from __future__ import annotations

import os
import time

import pytest

from stagerd.contract import layout
from stagerd.sinks import local
from stagerd.sinks.local import HOST, TEMP_STALE_S, LocalBackend
from stagerd.sinks.objects import ByteProgress, LocalFile

STEP = layout.step_dir_name(2)


@pytest.mark.parametrize("what", ["latest", "upload"])
def test_another_hosts_write_in_progress_survives_this_hosts_sweep(tmp_path, monkeypatch, what):
    """Host B writes `latest` (or a file of a step that fleet owners upload together) into the directory
    host A publishes to; A's sweep runs between B's temp file and its rename. B's pid is not alive on A, so
    A deleted B's temp file and B's write failed (FileNotFoundError, a retried publish)."""
    dest = tmp_path / "dest"
    (dest / STEP).mkdir(parents=True)
    src = tmp_path / "model.safetensors"
    src.write_bytes(b"x" * 1000)
    writer, real_replace, real_alive = os.getpid(), os.replace, local.pid_alive
    swept = []

    def host_a_sweeps_then_rename(tmp, dst, *args, **kwargs):
        # the sweeper is host A: B's pid (this process) means nothing there
        with monkeypatch.context() as a:
            a.setattr(local, "HOST", HOST, raising=False)
            a.setattr(local, "pid_alive", lambda pid: pid != writer and real_alive(pid))
            LocalBackend(dest).sweep(STEP)
        swept.append(os.path.basename(tmp))
        return real_replace(tmp, dst, *args, **kwargs)

    monkeypatch.setattr(local, "HOST", "hostB", raising=False)  # the writer is host B
    monkeypatch.setattr(os, "replace", host_a_sweeps_then_rename)
    b = LocalBackend(dest)
    if what == "latest":
        b.write("latest", b"step-00000002")
        assert (dest / "latest").read_bytes() == b"step-00000002"
    else:
        b.upload(STEP, [LocalFile("model.safetensors", src, 1000)], ByteProgress(1000, None))
        assert (dest / STEP / "model.safetensors").read_bytes() == src.read_bytes()
    assert swept and "hostB" in swept[0]


def test_which_temp_files_the_sweep_removes(tmp_path):
    """Ours of a dead pid: removed at once. Another host's, or an older stagerd's name with no host (its pid
    not alive here): a live writer on another host, kept until stale by the store's clock, then removed."""
    dest = tmp_path / "dest"
    (dest / STEP).mkdir(parents=True)
    dead, alive = 999_999_999, os.getpid()
    names = {
        f".latest.tmp-{HOST}-{dead}-1": False,  # ours, killed
        f".latest.tmp-{HOST}-{alive}-1": True,  # ours, writing
        f"{STEP}/.a.safetensors.tmp-{HOST}-{dead}-1": False,
        f".latest.tmp-node-7-{dead}-1": True,  # not ours to judge (a host name with `-` is no host here)
        f".latest.tmp-node_7-{dead}-1": True,  # another host's, fresh
        f"{STEP}/.b.safetensors.tmp-node_7-{dead}-2": True,
        f".latest.tmp-{dead}-1": True,  # an older stagerd's, fresh: maybe another host's, writing
        f"{STEP}/.c.safetensors.tmp-{dead}": True,
        f".latest.tmp-{alive}": True,  # an older stagerd's, its pid alive here
    }
    stale = {
        f".latest.tmp-node_8-{dead}-1": False,  # another host's, untouched for longer than TEMP_STALE_S
        f"{STEP}/.d.safetensors.tmp-node_8-{dead}-3": False,
        f".latest.tmp-{dead}-2": False,  # an older stagerd's (killed before the upgrade)
        f"{STEP}/.e.safetensors.tmp-{dead}-3": False,
        f".latest.tmp-{alive}-2": True,
    }
    old = time.time() - TEMP_STALE_S - 60
    for name in {**names, **stale}:
        (dest / name).write_bytes(b"partial")
    for name in stale:
        os.utime(dest / name, (old, old))
    (dest / ".notes.txt.tmp-999999999").write_bytes(b"another tool's")
    os.utime(dest / ".notes.txt.tmp-999999999", (old, old))
    LocalBackend(dest).sweep(STEP)
    assert {n: (dest / n).exists() for n in {**names, **stale}} == {**names, **stale}
    assert (dest / ".notes.txt.tmp-999999999").exists()
    assert [p.name for p in dest.iterdir() if "clock" in p.name] == []


def test_a_link_at_latests_temp_name_is_never_written_through(tmp_path):
    victim = tmp_path / "elsewhere.txt"
    victim.write_bytes(b"not stagerd's")
    dest = tmp_path / "dest"
    dest.mkdir()
    tmp = local._temp_name(dest / "latest")
    tmp.symlink_to(victim)
    LocalBackend(dest).write("latest", b"step-00000001")
    assert victim.read_bytes() == b"not stagerd's"
    assert (dest / "latest").read_bytes() == b"step-00000001" and not tmp.exists()


def test_the_fleets_commit_sweeps_a_killed_owners_temp_file_from_any_host(tmp_path):
    """The fleet's leader commits a step its owners uploaded: none of them writes under it any more, so a
    killed owner's partial file (another host's, fresh) goes; beside `latest` another host's stays."""
    from stagerd.sinks.fsspec import FsspecSink

    dest = tmp_path / "dest"
    sink = FsspecSink.from_url(dest.as_uri())
    src = tmp_path / "model.safetensors"
    src.write_bytes(b"x" * 1000)
    up = sink.backend.upload(STEP, [LocalFile("model.safetensors", src, 1000)], ByteProgress(1000, None))
    killed = dest / STEP / ".model.safetensors.tmp-node_7-999999999-1"
    writing = dest / ".latest.tmp-node_7-999999999-2"
    for p in (killed, writing):
        p.write_bytes(b"partial")
    assert sink.commit_uploaded(2, up)
    assert not killed.exists() and writing.exists()
    assert (dest / "latest").read_text() == STEP
