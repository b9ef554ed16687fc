"""Two containers of one Kubernetes pod share a host name, not their pids: what a live writer in the other
container names (a file:// temp file, a restore lease, a restore's temp directory, an S3 probe key, a prune
claim) carries this host name and a pid that is dead here. It must be judged by its age alone, as another
host's is; so must a name an older stagerd wrote with the host name alone.

Before the fix each was a killed writer's of this host and went at once: the sweep unlinked the other
container's temp file mid-write, a prune deleted the step its restore read, and so on."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stagerd.contract import layout
from stagerd.sinks import claims
from stagerd.sinks.fsspec import FsspecSink
from stagerd.sinks.leases import LEASE_TTL_S, RESTORING_DIR, dead_leases, live_leases
from stagerd.sinks.local import TEMP_STALE_S, LocalBackend
from stagerd.sinks.local_dirs import LocalTree
from stagerd.sinks.objects import CLOCK_NAME
from stagerd.sinks.remote import RemoteStore, StoredObject
from stagerd.sinks.s3.conditions import PROBE_PREFIX
from stagerd.sinks.temp_names import CLOCK_PROBE, HOST, STALE_S, pid_alive, restore_temp
from tests.cli_helpers import clean_env, run_cli
from tests.pid_namespaces import UNSHARE, unshare_works
from tests.s3server import s3, s3_server  # noqa: F401  (fixtures)

NAME = re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname())[:64] or "_"
# this host name in another pid namespace, and an older stagerd's HOST (the host name alone)
OTHERS = (f"{NAME}_pidns1", NAME)
STEP = layout.step_dir_name(2)


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _age(path: Path, seconds: float) -> None:
    """Set `path` and everything in it `seconds` into the past."""
    then = time.time() - seconds
    for p in [path, *(path.rglob("*") if path.is_dir() else [])]:
        os.utime(p, (then, then), follow_symlinks=False)


def test_this_host_names_carry_its_pid_namespace():
    assert f"{NAME}_pidns{os.stat('/proc/self/ns/pid').st_ino}" == HOST
    assert "-" not in HOST and HOST not in OTHERS


def test_a_file_sink_temp_file_of_another_pid_namespace_goes_only_when_old(tmp_path):
    dest = tmp_path / "dest"
    (dest / STEP).mkdir(parents=True)
    dead = _dead_pid()
    names = [n for o in OTHERS for n in (f".latest.tmp-{o}-{dead}-1", f"{STEP}/.a.bin.tmp-{o}-{dead}-1")]
    ours = dest / f".latest.tmp-{HOST}-{dead}-1"  # this container's killed writer's: goes at once
    for n in names:
        (dest / n).write_bytes(b"partial")
    ours.write_bytes(b"partial")
    LocalBackend(dest).sweep(STEP)
    assert not ours.exists()
    assert all((dest / n).exists() for n in names), "a live writer's of the next container was unlinked"
    for n in names:
        _age(dest / n, TEMP_STALE_S + 60)
    LocalBackend(dest).sweep(STEP)
    assert not any((dest / n).exists() for n in names)


def test_a_prune_clock_probe_of_another_pid_namespace_stays(tmp_path):
    """A prune reads the store's time from a file it writes and removes (`Held.clock`): the next
    container's, removed between the two, failed that prune."""
    dead = _dead_pid()
    theirs = [tmp_path / f".{CLOCK_NAME}.tmp-{o}-{dead}-1" for o in OTHERS]
    ours = tmp_path / f".{CLOCK_NAME}.tmp-{HOST}-{dead}-1"
    for f in (*theirs, ours):
        f.write_bytes(b"")
    with LocalTree(tmp_path).held("") as h:
        h.clock()
    assert not ours.exists()
    assert all(f.exists() for f in theirs), "a live prune's clock probe of the next container was removed"


def test_a_restore_lease_of_another_pid_namespace_protects_its_step_until_old():
    dead, now = _dead_pid(), 1_000_000.0
    for other in OTHERS:
        lease = f"step-00000003.{other}-{dead}-7"
        temp = f".step-00000003.{other}-{dead}-7.tmp-{other}-{dead}-7"
        young = {lease: StoredObject(10, now - 5), temp: StoredObject(2, now - 5)}
        assert live_leases(young, now) == {3}, other
        assert dead_leases(young, now) == [], other
        old = {k: StoredObject(v.size, now - LEASE_TTL_S - 1) for k, v in young.items()}
        assert live_leases(old, now) == set()
        assert sorted(dead_leases(old, now)) == sorted(young)
    ours = {f"step-00000003.{HOST}-{dead}-7": StoredObject(10, now - 5)}  # this container's killed restore
    assert live_leases(ours, now) == set() and dead_leases(ours, now) == list(ours)


def test_only_leases_and_their_temp_files_are_swept_from_restoring():
    """`restoring/` is stagerd's, but a name there that is no lease (a person's README, a `step-3` without
    a holder) was deleted once old like a killed restore's lease."""
    dead, now = _dead_pid(), 1_000_000.0
    old = now - LEASE_TTL_S - 1
    leases = {
        f"step-00000003.{HOST}-{dead}-7": StoredObject(10, old),
        f".step-00000003.{HOST}-{dead}-7.tmp-{HOST}-{dead}-7": StoredObject(2, old),
        "README.md": StoredObject(5, old),
        "step-00000003": StoredObject(5, old),
        f".notes.tmp-{HOST}-{dead}-7": StoredObject(5, old),
    }
    assert sorted(dead_leases(leases, now)) == sorted(list(leases)[:2])


@pytest.mark.parametrize("other", ["", "1"])
def test_a_prune_claim_of_another_pid_namespace_is_taken_over_only_when_old(other):
    """`other`: an older stagerd's claim (no namespace named: "") or another namespace's."""
    body = {"kind": claims.PRUNE, "owner": "x", "host": socket.gethostname(), "pid": _dead_pid()}
    theirs = claims.decode(json.dumps({**body, **({"pidns": other} if other else {})}).encode())
    assert theirs is not None and theirs.kind == claims.PRUNE
    assert not claims.prune_is_dead(theirs, 5.0), "a live prune in the next container was taken over"
    assert claims.prune_is_dead(theirs, claims.PRUNE_STALE_S + 1)
    ours = claims.decode(claims.prune_claim().encode())
    assert ours is not None and ours.pidns is not None
    killed = claims.decode(json.dumps({**body, "pidns": ours.pidns}).encode())
    assert killed is not None and claims.prune_is_dead(killed, 5.0)  # this namespace's killed prune


def test_a_restore_temp_dir_of_another_pid_namespace_or_an_older_stagerd_goes_only_when_old(tmp_path):
    out = tmp_path / "outs" / "eval"
    out.parent.mkdir()
    dead = _dead_pid()
    theirs = [f".eval.tmp-{o}-{dead}-1" for o in OTHERS] + [f".eval.restore-{dead}"]
    for n in theirs:
        (out.parent / n / "model").mkdir(parents=True)
        (out.parent / n / "model" / "part").write_bytes(b"x")
    ours = out.parent / f".eval.tmp-{HOST}-{dead}-1"
    ours.mkdir()
    restore_temp(out)
    assert not ours.exists()
    assert sorted(p.name for p in out.parent.iterdir()) == sorted(theirs)
    for n in theirs:
        _age(out.parent / n, STALE_S + 60)
    os.utime(out.parent / theirs[0] / "model" / "part")  # written just now: its writer is alive
    restore_temp(out)
    assert [p.name for p in out.parent.iterdir()] == [theirs[0]]


def test_a_killed_restores_clock_probe_goes_as_its_temp_dir_does(tmp_path):
    """A restore killed while it read the clock beside OUT (`temp_names._clock`) left its probe, which
    no sweep removed: this container's went never, another's never either."""
    out = tmp_path / "outs" / "eval"
    out.parent.mkdir()
    dead = _dead_pid()
    theirs = [f".{CLOCK_PROBE}.tmp-{o}-{dead}-1" for o in OTHERS]
    ours = f".{CLOCK_PROBE}.tmp-{HOST}-{dead}-1"
    for n in (*theirs, ours):
        (out.parent / n).mkdir()
    (out.parent / f".eval.tmp-{OTHERS[0]}-{dead}-1").mkdir()  # another's temp dir: the clock is read
    restore_temp(out)
    assert sorted(p.name for p in out.parent.iterdir()) == sorted(
        [*theirs, f".eval.tmp-{OTHERS[0]}-{dead}-1"]
    )
    for n in theirs:
        _age(out.parent / n, STALE_S + 60)
    restore_temp(out)
    assert [p.name for p in out.parent.iterdir()] == [f".eval.tmp-{OTHERS[0]}-{dead}-1"]


def test_an_s3_probe_key_of_another_pid_namespace_stays_while_young(s3, tmp_path):  # noqa: F811
    client = s3.client
    dead = _dead_pid()
    keys = [f"run/{PROBE_PREFIX}{o}-{dead}-{'ab' * 16}-{end}" for o in OTHERS for end in ("put", "delete")]
    ours = f"run/{PROBE_PREFIX}{HOST}-{dead}-{'cd' * 16}-put"
    for k in [*keys, ours]:
        client.put_object(Bucket=s3.bucket, Key=k, Body=b"stagerd probe\n")
    export = tmp_path / "export"
    export.mkdir()
    (export / "config.json").write_text("{}")
    sink = FsspecSink.from_url(s3.url("run"))
    sink.publish(export, 2)  # its probe's tidy-up deletes the dead probes' keys
    sink.close()
    left = set(s3.keys("run/"))
    assert ours not in left
    assert set(keys) <= left, "a live probe's keys of the next container were deleted"


# Run in a new pid namespace (this host name): fork until this process has `pid`, dead in the parent's
# namespace, then hold a restore lease on step 3 until stdin closes.
_HOLDER = """
import os, sys
want = int(sys.argv[2])
while os.getpid() != want:
    if os.getpid() > want:
        sys.exit(3)
    child = os.fork()
    if child == 0:
        continue
    os.waitpid(child, 0)
    os._exit(0)
from stagerd.sinks.local_dirs import LocalTree
from stagerd.sinks.leases import Lease
from stagerd.sinks.objects import CLOCK_NAME
from stagerd.sinks.remote import RemoteStore
with Lease(RemoteStore.open(sys.argv[1]), 3) as lease:
    print(lease.key, flush=True)
    sys.stdin.read()
"""


@pytest.mark.skipif(not unshare_works(), reason="no unprivileged user and pid namespaces here")
def test_a_restore_in_another_pid_namespace_keeps_its_step_from_a_prune(tmp_path):
    """A real process in another pid namespace, with a pid dead in this one, holds a restore lease: a
    real `stagerd prune` here keeps its step, and takes it once the lease is released."""
    url = (tmp_path / "sink").as_uri()
    sink = FsspecSink.from_url(url)
    for step in (3, 4):
        export = tmp_path / "exports" / str(step)
        export.mkdir(parents=True)
        (export / "config.json").write_text(f'{{"step": {step}}}')
        sink.publish(export, step)
    sink.close()
    pid = next(p for p in range(50, 30000) if not pid_alive(p))
    holder = subprocess.Popen(
        [*UNSHARE, sys.executable, "-c", _HOLDER, url, str(pid)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=clean_env(),
    )
    try:
        assert holder.stdout is not None and holder.stdin is not None
        key = holder.stdout.readline().strip()
        assert key.startswith(f"{RESTORING_DIR}/step-00000003.") and f"-{pid}-" in key, key
        assert not pid_alive(pid), "its pid came alive here: test is moot"
        r = run_cli(["prune", url, "--keep-last", "1"])
        assert r.returncode == 0, r.stderr
        manifest = tmp_path / "sink" / layout.step_dir_name(3) / layout.MANIFEST_NAME
        assert manifest.is_file(), f"the step a live restore reads was pruned: {r.stdout}"
        assert (tmp_path / "sink" / key).is_file()
        holder.stdin.close()
        assert holder.wait(timeout=60) == 0
    finally:
        holder.kill()
        holder.wait()
    r = run_cli(["prune", url, "--keep-last", "1"])
    assert r.returncode == 0, r.stderr
    assert not manifest.exists(), r.stdout
    store = RemoteStore.open(url)
    assert store.objects(RESTORING_DIR) == {}
    store.close()
