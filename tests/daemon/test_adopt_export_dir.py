"""`watch --adopt --export-dir` that cannot be an export directory (a file, a path under a file, a place
where no directory can be made, ROOT's `.stagerd`) is a ConfigError naming --export-dir, exit 2, before
ROOT is locked or its fleet identity written: nothing is left behind."""

from __future__ import annotations

from pathlib import Path

from tests.cli_helpers import run_cli


def test_an_export_dir_that_cannot_be_one_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    afile = tmp_path / "afile"
    afile.write_text("x")
    sink = tmp_path / "sink"
    for export_dir in (
        afile,
        afile / "sub",
        Path("/proc/stagerd-no"),
        root / ".stagerd",
        root / ".stagerd/x",
    ):
        r = run_cli(
            ["watch", root, "--adopt", "--export-dir", export_dir, "--sink", sink.as_uri(), "--once"],
            timeout=60,
        )
        assert r.returncode == 2 and "stagerd: ConfigError: " in r.stderr, (export_dir, r.stderr)
        assert "--export-dir" in r.stderr and "Traceback" not in r.stderr, r.stderr
        assert list(root.iterdir()) == [], export_dir  # no .stagerd/lock, no fleet-root-id
        assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "root"], export_dir
    assert afile.read_text() == "x"
