"""A `stagerd restore --export` SIGKILLed mid-download (`restore.piece`) from file://, S3 and the Hub: it
leaves nothing that looks restored, its lease protects nothing once it is dead, and the next restore
removes what it left: the lease, and the temp directory beside OUT.

Before the fix the temp directory `.OUT.restore-PID` stayed for good (the next restore used its own pid),
and so did the lease `restoring/step-N.<random>`: it kept the step from every prune for 15 minutes and
was never deleted; on file:// a lease write killed between its temp file and the rename left
`restoring/.step-N.<random>.tmp-PID` for good too.
"""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from stagerd.contract import layout
from stagerd.sinks.fsspec import FsspecSink
from stagerd.sinks.leases import RESTORING_DIR, Lease
from stagerd.sinks.remote import RemoteStore
from stagerd.sinks.temp_names import HOST
from tests.cli_helpers import run_cli
from tests.cmd.restore_helpers import hub_with_step, run_restore, tree
from tests.s3server import s3, s3_server  # noqa: F401  (fixtures)

CRASH = {"STAGERD_CRASH_AT": "restore.piece:2"}


def _export(d, step: int):
    d.mkdir(parents=True)
    (d / "model.safetensors").write_bytes(bytes(range(256)) * (8 << 10) + bytes([step]))  # 2 MiB, 2 pieces+
    (d / "config.json").write_text(f'{{"step": {step}}}')
    return d


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _siblings(out) -> list[str]:
    return sorted(p.name for p in out.parent.iterdir())


@pytest.mark.parametrize("kind", ["file", "s3"])
def test_a_killed_restore_leaves_no_lease_and_no_temp_dir_for_good(tmp_path, kind, s3):  # noqa: F811
    url = (tmp_path / "sink").as_uri() if kind == "file" else s3.url("run")
    sink = FsspecSink.from_url(url)
    for step in (4, 5):
        sink.publish(_export(tmp_path / "exports" / str(step), step), step)
    sink.close()
    store = RemoteStore.open(url)
    out = tmp_path / "outs" / "eval"

    killed = run_restore(url, out, "--export", "--step", "4", env=CRASH)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert not out.exists()  # nothing that looks restored
    assert [n for n in _siblings(out) if n.startswith(".eval.")], "the kill left no temp dir: test is moot"
    assert list(store.objects(RESTORING_DIR)), "the kill left no lease: test is moot"

    # the dead restore's lease protects nothing: a prune takes step 4 at once
    r = run_cli(["prune", url, "--keep-last", "1"])
    assert r.returncode == 0, r.stderr
    assert store.read(f"{layout.step_dir_name(4)}/{layout.MANIFEST_NAME}") is None, r.stdout

    r = run_restore(url, out, "--export", "--step", "5")
    assert r.returncode == 0, r.stderr
    assert tree(out) == tree(tmp_path / "exports" / "5")
    assert _siblings(out) == ["eval"]  # the killed restore's temp dir went with the next restore
    assert store.objects(RESTORING_DIR) == {}  # and so did its lease
    store.close()


def test_a_lease_write_killed_before_its_rename_is_swept_by_the_next_lease(tmp_path):
    """file://: the lease is written to a temp name that says its writer (`.step-N.HOLDER.tmp-HOST-PID-TID`);
    a dead writer's of this host goes when the next restore takes its lease, a live one's stays."""
    sink = tmp_path / "sink"
    leases = sink / RESTORING_DIR
    leases.mkdir(parents=True)
    dead = _dead_pid()
    left = leases / f".step-00000003.{HOST}-{dead}-1.tmp-{HOST}-{dead}-1"
    left.write_bytes(b"{}")
    live = leases / f".step-00000003.{HOST}-1-1.tmp-{HOST}-1-1"  # pid 1 is alive
    live.write_bytes(b"{}")
    lease_of_dead = leases / f"step-00000003.{HOST}-{dead}-7"
    lease_of_dead.write_bytes(b"{}")
    store = RemoteStore.open(sink.as_uri())
    with Lease(store, 2) as lease:
        assert (sink / lease.key).is_file()
        assert f".{HOST}-" in lease.key  # says its holder, as temp names do
        assert sorted(p.name for p in leases.iterdir()) == sorted([live.name, lease.key.split("/")[1]])
    assert sorted(p.name for p in leases.iterdir()) == [live.name]
    store.close()


def test_a_restore_from_the_hub_killed_midway_leaves_no_temp_dir_for_good(tmp_path):
    from tests.sinks.hub.hub_helpers import export_files

    with hub_with_step(tmp_path) as (_, url, env, export):
        out = tmp_path / "outs" / "eval"
        killed = run_restore(url, out, "--export", "--step", "7", env={**env, **CRASH})
        assert killed.returncode == -signal.SIGKILL, killed.stderr
        assert not out.exists()
        assert [n for n in _siblings(out) if n.startswith(".eval.")], (
            "the kill left no temp dir: test is moot"
        )
        r = run_restore(url, out, "--export", "--step", "7", env=env)
        assert r.returncode == 0, r.stderr
        assert {k: v for k, v in tree(out).items() if k != "README.md"} == export_files(export)
        assert _siblings(out) == ["eval"]
