"""A daemon on a moved or copied ROOT touches only that ROOT (issue 19, item 1).

The journal used to store each step's absolute path, and recovery and retention trusted it: after
`mv ROOT ROOT-old` and a new run staging into a new ROOT, `watch ROOT-old --keep-last 0` deleted the new
run's unpublished steps. The journal now keeps only each step directory's name in its ROOT.
"""

from __future__ import annotations

import sqlite3

from stagerd.daemon.journal import Journal, journal_path
from tests.cli_helpers import run_cli
from tests.daemon_helpers import DROP_HINTS, fast_flags, stage_copy


def test_a_daemon_on_a_moved_root_never_touches_the_root_now_at_the_old_place(tmp_path, dcp_mixed2):
    model, _ = dcp_mixed2
    root, old, sink = tmp_path / "root", tmp_path / "root-old", tmp_path / "sink"
    for step in (100, 200, 300):
        stage_copy(root, step, model, world=2)
    first = run_cli(["watch", root, "--sink", sink.as_uri(), "--once", *fast_flags()])
    assert first.returncode == 0, first.stderr[-3000:]
    root.rename(old)
    for step in (100, 200, 300):  # a new run stages fresh steps where the old ROOT was
        stage_copy(root, step, model, world=2, metadata={"run": "new"})

    moved = run_cli(["watch", old, "--sink", sink.as_uri(), "--once", "--keep-last", "0", *fast_flags()])
    assert moved.returncode == 0, moved.stderr[-3000:]
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("step-")) == [
        "step-00000100",
        "step-00000200",
        "step-00000300",
    ]
    assert not [p for p in old.iterdir() if p.name.startswith("step-")]  # its own published steps went


def test_a_schema_1_journal_with_absolute_paths_keeps_only_names_after_the_upgrade(tmp_path):
    journal = Journal.open(tmp_path)
    journal.add_step(5, tmp_path / "step-00000005", 1.0, "sha256:x")
    journal.close()
    conn = sqlite3.connect(journal_path(tmp_path))
    for sql in ("ALTER TABLE steps DROP COLUMN marker_id", *DROP_HINTS):
        conn.execute(sql)
    conn.execute("UPDATE steps SET path = '/elsewhere/root/step-00000005'")
    conn.execute("PRAGMA user_version=1")
    conn.commit()
    conn.close()

    journal = Journal.open(tmp_path)
    try:
        row = journal.step(5)
        assert row is not None and row.path == str(tmp_path / "step-00000005")
    finally:
        journal.close()
    stored = sqlite3.connect(journal_path(tmp_path)).execute("SELECT path FROM steps").fetchall()
    assert stored == [("step-00000005",)]
