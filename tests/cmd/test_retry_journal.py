"""`retry` writes only a journal `status` can read: a damaged one, an empty file or an unrelated SQLite file
at the journal's name is refused with the JournalError `status` gives, never set up anew (its lanes' states
lost), and a missing ROOT or a file given as ROOT is named as `status` names it."""

from __future__ import annotations

import contextlib
import sqlite3
from pathlib import Path

import pytest

from stagerd.daemon.journal import Journal, journal_path
from tests.cli_helpers import run_cli


# Each connection is closed as it ends (sqlite3's `with` only commits): the journal is in WAL mode, and the
# last connection's close writes the WAL into the file, so one left to the garbage collector changed the
# file's bytes after the test read them, whichever way `retry` went.
def _tables(path: Path) -> set[str]:
    with contextlib.closing(sqlite3.connect(path)) as c:
        return {r[0] for r in c.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}


def _lanes_dropped(path: Path) -> None:
    with contextlib.closing(sqlite3.connect(path)) as c, c:
        c.execute("DROP TABLE lanes")


def _emptied(path: Path) -> None:
    path.write_bytes(b"")


def _unrelated(path: Path) -> None:
    path.unlink()
    with contextlib.closing(sqlite3.connect(path)) as c, c:
        c.execute("CREATE TABLE notes (t TEXT)")


@pytest.mark.parametrize("damage", [_lanes_dropped, _emptied, _unrelated])
def test_retry_refuses_a_journal_status_calls_damaged(tmp_path: Path, damage) -> None:
    root = tmp_path / "root"
    Journal.open(root).close()
    path = journal_path(root)
    damage(path)
    before = path.read_bytes()
    tables = _tables(path) if before else set()
    status = run_cli(["status", root])
    r = run_cli(["retry", root])
    assert r.returncode == 2 and "stagerd: JournalError: " in r.stderr, r.stderr + r.stdout
    assert r.stderr == status.stderr and status.returncode == 2, (r.stderr, status.stderr)
    assert path.read_bytes() == before  # nothing set up in it
    if before:
        assert _tables(path) == tables


def test_retry_names_a_missing_root_or_a_file_as_status_does(tmp_path: Path) -> None:
    afile = tmp_path / "afile"
    afile.write_text("x")
    for root, what in ((tmp_path / "none", "ROOT does not exist"), (afile, "ROOT is not a directory")):
        r = run_cli(["retry", root])
        assert r.returncode == 2 and what in r.stderr and "start `stagerd watch" not in r.stderr, r.stderr
    assert not (tmp_path / "none").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["afile"]


def test_retry_takes_a_sink_spelt_either_way(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A lane is keyed by its sink as the daemon was given it: `--sink` names it as `/x`, `file:///x` or
    with a trailing slash alike, and a raw lane by `raw:` and the sink spelt either way."""
    from stagerd.cli import main

    root, bare, uri = tmp_path / "root", tmp_path / "bare", (tmp_path / "uri").as_uri()
    journal = Journal.open(root)
    journal.add_step(1, root / "step-00000001", 0.0)
    journal.begin_export(1)
    journal.finish_export(
        1, [str(bare), uri], seconds=1, export_bytes=1, tensor_bytes=1, files=1, skipped=False
    )
    for sink in (str(bare), uri):
        journal.quarantine_lane(1, sink, "SinkError", "down")
    journal.add_raw_lane(1, f"raw:{bare}")
    journal.quarantine_lane(1, f"raw:{bare}", "SinkError", "down")
    journal.close()
    for given, lane in (
        (f"{bare.as_uri()}/", str(bare)),
        (f"{tmp_path / 'uri'}/", uri),
        (f"raw:{bare.as_uri()}", f"raw:{bare}"),
    ):
        assert main(["retry", str(root), "--sink", given]) == 0
        out = capsys.readouterr().out
        assert out == f"re-armed step 1 on {lane}: quarantined -> pending\n", out
    assert main(["retry", str(root), "--sink", (tmp_path / "other").as_uri()]) == 2
    assert "no sink" in capsys.readouterr().err
