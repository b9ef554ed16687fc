"""An OUT that is a mount point (an empty disk mounted for the export, a very natural OUT): `consolidate`
and `restore --export` finish by renaming their temp directory onto OUT, which a mount point cannot take.
Lives here for the real tmpfs fixture."""

from __future__ import annotations

from pathlib import Path

from stagerd.sinks.fsspec import FsspecSink
from tests.cli_helpers import run_cli
from tests.daemon_helpers import stage_copy


def test_an_out_that_is_a_mount_point_is_refused_before_any_work(tmp_path: Path, tmpfs, dcp_mixed2) -> None:
    """Before: the whole export was built or downloaded, then `os.rmdir(OUT)` raised EBUSY: a traceback,
    exit 1."""
    step_dir = stage_copy(tmp_path / "root", 3, dcp_mixed2[0], 2)
    export = tmp_path / "hf-3"
    assert run_cli(["consolidate", step_dir, export]).returncode == 0
    sink = tmp_path / "sink"
    FsspecSink.from_url(sink.as_uri()).publish(export, 3)
    mnt = tmpfs(64 << 20)
    for argv in (
        ["consolidate", step_dir, mnt],
        ["restore", sink.as_uri(), mnt, "--export", "--step", "3"],
    ):
        r = run_cli(argv)
        assert r.returncode == 2 and "stagerd: ConfigError: " in r.stderr, r.stderr
        assert "OUT is a mount point" in r.stderr and f"e.g. {mnt / 'hf'}" in r.stderr, r.stderr
        assert "Traceback" not in r.stderr
        assert not any(mnt.iterdir()) and sorted(p.name for p in tmp_path.iterdir()) == [
            "fs0", "hf-3", "root", "sink"
        ]  # fmt: skip
    r = run_cli(["consolidate", step_dir, mnt / "hf"])  # as the hint says
    assert r.returncode == 0, r.stderr
    assert (mnt / "hf" / "model.safetensors").is_file()
